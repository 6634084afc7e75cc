//! No credential in any output: each secret a MongoDB or AMQP URI can carry, inline or read
//! from a `*_FILE`, is absent from `check-config`, from the errors and trace-level logs of the
//! one-shot commands, and from a running daemon's logs and endpoints.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::process::{Command, Output};
use std::time::Duration;

use common::fleet::{BIN, Daemon, http_get};
use common::proxy::host_port;
use common::*;

const MONGO_PW: &str = "m0ngo-pw-5e1";
const KEY_PW: &str = "keyfile-pw-9a2";
const TOKEN: &str = "aws-t0ken-77b";
const PROXY_PW: &str = "proxy-pw-3c4";
const AMQP_PW: &str = "amqp-pw-6d8";
const FILE_SECRET: &str = "plain-secret-8f1";
const ALL: &[&str] = &[MONGO_PW, KEY_PW, TOKEN, PROXY_PW, AMQP_PW, FILE_SECRET];

/// A MongoDB URI on `host` carrying every secret option the connection-string spec names.
fn secret_mongodb_uri(host: &str) -> String {
    format!(
        "mongodb://timeoutd:{MONGO_PW}@{host}/?tlsCertificateKeyFilePassword={KEY_PW}\
         &authMechanismProperties=AWS_SESSION_TOKEN:{TOKEN}&proxyHost=127.0.0.1&proxyPort=9\
         &proxyUsername=timeoutd&proxyPassword={PROXY_PW}&serverSelectionTimeoutMS=2000"
    )
}

fn secret_amqp_uri() -> String {
    format!("amqp://guest:{AMQP_PW}@{}/%2f", host_port(&amqp_uri()))
}

fn mongo_host() -> String {
    let uri = mongo_uri();
    let rest = uri.split_once("://").map_or(uri.as_str(), |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest).to_string()
}

fn timeoutd(args: &[&str], vars: &[(&str, String)]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "trace")
        .env("NO_COLOR", "1")
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run timeoutd")
}

fn text_of(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_no_secret(what: &str, text: &str) {
    for s in ALL {
        assert!(!text.contains(s), "{what} shows {s}:\n{text}");
    }
}

#[test]
fn check_config_hides_every_credential_inline_and_from_files() {
    let mongodb = secret_mongodb_uri("db.example:27017");
    let inline = timeoutd(
        &["check-config"],
        &[
            ("TIMEOUTD_MONGODB__URI", mongodb.clone()),
            ("TIMEOUTD_RABBITMQ__URI", secret_amqp_uri()),
        ],
    );
    let shown = text_of(&inline);
    assert!(inline.status.success(), "{shown}");
    assert_no_secret("check-config", &shown);
    // What is not secret stays, so the output still says where timeoutd connects.
    for kept in [
        "mongodb://timeoutd:***@db.example:27017/",
        "tlsCertificateKeyFilePassword=***",
        "AWS_SESSION_TOKEN:***",
        "proxyPassword=***",
        "amqp://guest:***@",
    ] {
        assert!(shown.contains(kept), "{kept} in {shown}");
    }

    let dir = tempfile::tempdir().expect("temp dir");
    let mongodb_file = dir.path().join("mongodb-uri");
    let amqp_file = dir.path().join("amqp-uri");
    std::fs::write(&mongodb_file, format!("{mongodb}\n")).unwrap();
    std::fs::write(&amqp_file, secret_amqp_uri()).unwrap();
    let from_files = timeoutd(
        &["check-config"],
        &[
            (
                "TIMEOUTD_MONGODB__URI_FILE",
                mongodb_file.display().to_string(),
            ),
            (
                "TIMEOUTD_RABBITMQ__URI_FILE",
                amqp_file.display().to_string(),
            ),
        ],
    );
    let shown = text_of(&from_files);
    assert!(from_files.status.success(), "{shown}");
    assert_no_secret("check-config with *_FILE", &shown);
    assert!(shown.contains("AWS_SESSION_TOKEN:***"), "{shown}");

    // A secret file holding something that is not a URI: refused, and not echoed.
    std::fs::write(&amqp_file, FILE_SECRET).unwrap();
    let wrong = timeoutd(
        &["check-config"],
        &[(
            "TIMEOUTD_RABBITMQ__URI_FILE",
            amqp_file.display().to_string(),
        )],
    );
    assert_eq!(wrong.status.code(), Some(2), "{}", text_of(&wrong));
    assert_no_secret("check-config with a bad *_FILE", &text_of(&wrong));
}

#[test]
fn a_list_of_rabbitmq_nodes_from_the_environment_or_a_file_is_shown_per_node_redacted() {
    let list =
        format!("amqp://guest:{AMQP_PW}@rabbit-1:5672/%2f,amqps://svc:{AMQP_PW}@rabbit-2/%2f");
    let out = timeoutd(
        &["check-config"],
        &[("TIMEOUTD_RABBITMQ__URI", list.clone())],
    );
    let shown = text_of(&out);
    assert!(out.status.success(), "{shown}");
    assert_no_secret("check-config with a node list", &shown);
    for kept in [
        "amqp://guest:***@rabbit-1:5672/%2f",
        "amqps://svc:***@rabbit-2/%2f",
    ] {
        assert!(shown.contains(kept), "{kept} in {shown}");
    }

    // One URI a line in a mounted secret.
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("amqp-uris");
    std::fs::write(&file, format!("{}\n", list.replace(',', "\n"))).unwrap();
    let out = timeoutd(
        &["check-config"],
        &[("TIMEOUTD_RABBITMQ__URI_FILE", file.display().to_string())],
    );
    let shown = text_of(&out);
    assert!(out.status.success(), "{shown}");
    assert_no_secret("check-config with a node list file", &shown);
    assert!(
        shown.contains("@rabbit-1:5672") && shown.contains("@rabbit-2/"),
        "{shown}"
    );

    // A bad entry is named by its position, its password hidden.
    let bad = format!("amqp://guest:{AMQP_PW}@rabbit-1/%2f,amqps//guest:{AMQP_PW}@rabbit-2");
    let out = timeoutd(&["check-config"], &[("TIMEOUTD_RABBITMQ__URI", bad)]);
    let shown = text_of(&out);
    assert_eq!(out.status.code(), Some(2), "{shown}");
    assert!(
        shown.contains("rabbitmq.uri") && shown.contains("entry 2"),
        "{shown}"
    );
    assert_no_secret("check-config with a bad node", &shown);
}

#[test]
fn one_shot_command_errors_and_trace_logs_hide_credentials() {
    let host = mongo_host();
    // Through a proxy that is not there, and, without it, the server refuses the password:
    // two different error paths.
    let without_key_pw = format!(
        "mongodb://timeoutd:{MONGO_PW}@{host}/?authMechanismProperties=SERVICE_NAME:{TOKEN}\
         &serverSelectionTimeoutMS=2000"
    );
    for uri in [secret_mongodb_uri(&host), without_key_pw] {
        for args in [&["stats"][..], &["reap"], &["parked", "list"]] {
            let out = timeoutd(
                args,
                &[
                    ("TIMEOUTD_MONGODB__URI", uri.clone()),
                    ("TIMEOUTD_RABBITMQ__URI", secret_amqp_uri()),
                ],
            );
            let shown = text_of(&out);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {shown}");
            assert!(shown.contains("error"), "{args:?} says why: {shown}");
            assert_no_secret(&format!("{args:?}"), &shown);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_daemon_hides_credentials_in_trace_logs_and_endpoints() {
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let amqp_file = dir.path().join("amqp-uri");
    std::fs::write(&amqp_file, secret_amqp_uri()).unwrap();
    let mut vars = env.env_vars(&env.config());
    vars.retain(|(k, _)| k != "TIMEOUTD_RABBITMQ__URI");
    vars.push((
        "TIMEOUTD_RABBITMQ__URI_FILE".into(),
        amqp_file.display().to_string(),
    ));
    vars.push(("RUST_LOG".into(), "trace".into()));
    let mut d = Daemon::spawn("timeoutd", vars).await;
    // RabbitMQ refuses the password; the daemon keeps trying and says so.
    assert!(
        d.logged("RabbitMQ unreachable", Duration::from_secs(20))
            .await,
        "the refused login is logged"
    );
    let mut seen = Vec::new();
    for path in ["/metrics", "/readyz", "/healthz"] {
        seen.push(http_get(format!("{}{path}", d.base)).await.1);
    }
    d.sigterm();
    d.wait(Duration::from_secs(30)).await;
    seen.extend(d.logs());
    assert_no_secret("the daemon", &seen.join("\n"));
    env.cleanup().await;
}
