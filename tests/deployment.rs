//! The deployment files: the systemd unit, the Dockerfile and the Kubernetes manifests are
//! checked with the tools their platforms use, offline.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use timeoutd::config::Config;

const BIN: &str = env!("CARGO_BIN_EXE_timeoutd");

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The value of `Key=` in a unit file, as a duration in seconds.
fn unit_seconds(unit: &str, key: &str) -> Duration {
    let value = unit
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("{key} missing from the unit"));
    humantime::parse_duration(value.trim()).unwrap()
}

#[test]
fn systemd_unit_verifies_and_outlasts_the_drain() {
    let unit = std::fs::read_to_string(repo("systemd/timeoutd.service")).unwrap();
    // verify checks that ExecStart exists: point it at the binary just built.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timeoutd.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/timeoutd", BIN)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian package systemd)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.trim().is_empty(), "warnings: {stderr}");

    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let exposure: f64 = text
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for timeoutd.service: "))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in: {text}"));
    assert!(exposure <= 2.0, "exposure {exposure}: {text}");

    // systemd must not kill a drain that timeoutd itself bounds.
    let d = Config::default().dispatch;
    let drain = d.shutdown_timeout + timeoutd::daemon::SHUTDOWN_GRACE;
    assert!(unit_seconds(&unit, "TimeoutStopSec") > drain);
    // The watchdog must allow the three poll intervals that /healthz allows.
    assert!(unit_seconds(&unit, "WatchdogSec") > d.poll_interval * 3);
    assert!(unit.contains("Type=notify"));
    assert!(unit.contains("RestartPreventExitStatus=2"));
}
