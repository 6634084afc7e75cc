//! MongoDB over TLS: timeoutd's `[mongodb] tls_ca_file` and `tls_certificate_key_file`
//! against SecantusDB's Python server serving TLS only and requiring client certificates,
//! with a self-signed CA (`scripts/start-tls-secantus.sh`). It connects with both, is
//! refused without either or without TLS, and a daemon dispatches over it.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::fleet::{BIN, Daemon};
use common::*;
use uuid::Uuid;

/// The TLS server, stopped when the test ends (also on a failed assertion).
struct TlsServer {
    uri: String,
    dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl TlsServer {
    fn start() -> TlsServer {
        let tmp = tempfile::tempdir().expect("temp dir");
        let out = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/scripts/start-tls-secantus.sh"
            ))
            .arg(tmp.path())
            .output()
            .expect("run scripts/start-tls-secantus.sh");
        assert!(
            out.status.success(),
            "scripts/start-tls-secantus.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut lines = stdout.lines();
        let uri = lines.next().expect("uri line").to_string();
        let dir = PathBuf::from(lines.next().expect("dir line"));
        TlsServer {
            uri,
            dir,
            _tmp: tmp,
        }
    }

    /// The URI with a short server selection, so a refused connection fails fast.
    fn uri(&self) -> String {
        format!("{}?serverSelectionTimeoutMS=5000", self.uri)
    }

    fn vars(&self, ca: bool, client_cert: bool) -> Vec<(String, String)> {
        let mut v = vec![("TIMEOUTD_MONGODB__URI".to_string(), self.uri())];
        if ca {
            v.push((
                "TIMEOUTD_MONGODB__TLS_CA_FILE".into(),
                self.dir.join("ca.pem").display().to_string(),
            ));
        }
        if client_cert {
            v.push((
                "TIMEOUTD_MONGODB__TLS_CERTIFICATE_KEY_FILE".into(),
                self.dir.join("client-combined.pem").display().to_string(),
            ));
        }
        v
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
    }
}

#[test]
fn tls_needs_the_ca_and_the_client_certificate() {
    let server = TlsServer::start();
    let db = format!(
        "timeoutd_tls_{}",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    for (ca, cert, connects) in [
        (true, true, true),
        (true, false, false),
        (false, true, false),
        (false, false, false),
    ] {
        let out = Command::new(BIN)
            .arg("stats")
            .envs(server.vars(ca, cert))
            .env("TIMEOUTD_MONGODB__DATABASE", &db)
            .output()
            .expect("run timeoutd stats");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if connects {
            assert!(out.status.success(), "ca and client certificate: {stderr}");
            assert!(stdout.starts_with("pending "), "{stdout}");
            assert!(stderr.is_empty(), "{stderr}");
        } else {
            assert_eq!(
                out.status.code(),
                Some(1),
                "ca={ca} cert={cert}: {stdout}{stderr}"
            );
            assert!(
                stderr.contains("cannot reach MongoDB") && !stderr.contains("panicked"),
                "ca={ca} cert={cert}: {stderr}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_dispatches_over_mongodb_tls() {
    let server = TlsServer::start();
    let env = TestEnv::new().await;
    let mut vars = env.env_vars(&env.config());
    vars.retain(|(k, _)| k != "TIMEOUTD_MONGODB__URI");
    vars.extend(server.vars(true, true));
    let mut consumer = env.consumer().await;
    // Scheduled over TLS with the one-shot command, fired over TLS by the daemon.
    let n = 3;
    for i in 0..n {
        let out = Command::new(BIN)
            .args(["schedule", "--destination", &env.queue, "--in", "1s"])
            .args(["--correlation-id", &Uuid::new_v4().to_string()])
            .envs(vars.clone())
            .output()
            .expect("run timeoutd schedule");
        assert!(
            out.status.success(),
            "schedule {i} over TLS: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let d = Daemon::spawn("timeoutd-tls", vars).await;
    let got = consumer.take(n, Duration::from_secs(60)).await;
    assert_eq!(got.len(), n, "{}", d.logs().join("\n"));
    assert!(d.ready_is(200, Duration::from_secs(30)).await);
    d.stop().await;
    env.cleanup().await;
}
