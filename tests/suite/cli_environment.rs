//! What the CLI takes from its environment: `TIMEOUTD_CONFIG` names the config file after
//! `--config`; an ignored `TIMEOUTD_*` variable and an invalid `RUST_LOG` are warned about;
//! `check-config` names the file it read, and `--connect` reaches both servers (or exits 1,
//! saying so once).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;
use crate::common::fleet::BIN;
use crate::common::fleet::run;
use crate::temp_config;

use std::process::Command;

use common::*;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn timeoutd_config_selects_the_file_after_the_flag() {
    let from_env = temp_config("[dispatch]\nbatch_size = 77\n");
    let from_flag = temp_config("[dispatch]\nbatch_size = 88\n");
    let env_path = from_env.path().to_str().unwrap();
    let var = |p: &str| vec![("TIMEOUTD_CONFIG".to_string(), p.to_string())];

    let out = run(&["check-config"], &var(env_path));
    let shown = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(shown.contains("batch_size = 77"), "{shown}");
    assert!(
        shown.starts_with(&format!("# read {env_path}")),
        "names the file: {shown}"
    );

    let flag = from_flag.path().to_str().unwrap();
    let out = run(&["check-config", "--config", flag], &var(env_path));
    assert!(
        text(&out.stdout).contains("batch_size = 88"),
        "--config wins"
    );

    let out = run(&["check-config"], &var("/nonexistent/timeoutd.toml"));
    assert_eq!(out.status.code(), Some(2), "a named file must exist");
    assert!(text(&out.stderr).contains("/nonexistent/timeoutd.toml"));
}

#[test]
fn ignored_variables_and_an_invalid_rust_log_are_warned_about() {
    let f = temp_config("");
    let path = f.path().to_str().unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config", path])
        .env("TIMEOUTD_MONGODB_URI", "mongodb://meant-this:27017")
        .env("RUST_LOG", "timeoutd=loud")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("TIMEOUTD_MONGODB_URI is ignored") && err.contains("TIMEOUTD_MONGODB__URI"),
        "{err}"
    );
    assert!(err.contains("RUST_LOG=\"timeoutd=loud\""), "{err}");
    assert!(!text(&out.stdout).contains("meant-this"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_connect_reports_both_servers_or_exits_1() {
    let env = TestEnv::new().await;
    let vars = env.env_vars(&env.config());
    let o = run(&["check-config", "--connect", "--json"], &vars);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(o.stderr.is_empty(), "{}", text(&o.stderr));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (m, r) = (&out["connect"]["mongodb"], &out["connect"]["rabbitmq"]);
    assert_eq!(m["ok"], true, "{out}");
    assert!(m["clock_offset_ms"].is_i64(), "{out}");
    assert!(m["version"].is_string(), "{out}");
    assert_eq!(r["ok"], true, "{out}");
    assert!(
        r["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("RabbitMQ ")),
        "{out}"
    );
    assert!(out["source"]["file"].is_string(), "{out}");

    // A broker that is not there: both reported, exit 1, the error once.
    let mut vars = vars;
    vars.push((
        "TIMEOUTD_RABBITMQ__URI".into(),
        "amqp://guest:guest@127.0.0.1:9/%2f".into(),
    ));
    let o = run(&["check-config", "--connect"], &vars);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("# mongodb: answered"), "{stdout}");
    assert!(stdout.contains("# rabbitmq: UNREACHABLE"), "{stdout}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("RabbitMQ did not answer"), "{stderr}");
    env.cleanup().await;
}
