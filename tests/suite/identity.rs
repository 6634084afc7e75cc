//! Which build is running: `timeoutd --version` and `timeoutd_build_info`.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common::fleet::BIN;
use std::process::Command;

/// The commit this checkout is at, when it is a git checkout with git installed.
fn git_head() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn version_names_the_version_the_commit_and_the_build_date() {
    for flag in ["--version", "-V"] {
        let out = Command::new(BIN).arg(flag).output().expect("run timeoutd");
        assert!(out.status.success(), "{flag}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let rest = text
            .strip_prefix(&format!("timeoutd {} (commit ", env!("CARGO_PKG_VERSION")))
            .unwrap_or_else(|| panic!("{flag} printed {text}"));
        let (commit, rest) = rest.split_once(", built ").expect(&text);
        let date = rest.strip_suffix(')').expect(&text);
        assert!(
            commit == "unknown"
                || (commit.len() == 40 && commit.chars().all(|c| c.is_ascii_hexdigit())),
            "{text}"
        );
        // A build from a git checkout names its commit (each commit of this test re-runs
        // build.rs: it watches HEAD and the branch's ref).
        if let Some(head) = git_head() {
            assert_eq!(commit, head, "{text}");
        }
        let parts: Vec<&str> = date.split('-').collect();
        assert!(
            parts.len() == 3
                && [4, 2, 2]
                    .iter()
                    .zip(&parts)
                    .all(|(n, p)| p.len() == *n && p.chars().all(|c| c.is_ascii_digit())),
            "the build date is not YYYY-MM-DD: {text}"
        );
    }
}

#[test]
fn build_info_carries_the_version_and_the_revision() {
    let text = timeoutd::service::http::prometheus().render();
    let line = text
        .lines()
        .find(|l| l.starts_with("timeoutd_build_info{"))
        .unwrap_or_else(|| panic!("no timeoutd_build_info:\n{text}"));
    assert!(
        line.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{line}"
    );
    assert!(
        line.contains(&format!(
            "revision=\"{}\"",
            timeoutd::service::buildinfo::REVISION
        )),
        "{line}"
    );
    assert!(line.ends_with(" 1"), "{line}");
    if let Some(head) = git_head() {
        assert_eq!(timeoutd::service::buildinfo::REVISION, head);
    }
}
