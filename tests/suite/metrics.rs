//! `/metrics` as Prometheus judges it: `promtool check metrics` on live scrapes of a real
//! daemon finds nothing, every counter and known label value is there at zero before its
//! first event, and every series the code records has HELP text and a row in docs/operations.md.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::fleet::{Daemon, DeliveryCounter};
use common::*;
use timeoutd::metrics::{Kind, SERIES, Start};

/// `promtool check metrics` on `text`: its findings (empty when it accepts the scrape).
fn promtool_findings(text: &str) -> String {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package): run scripts/install-prometheus.sh");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool output");
    let findings = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && findings.trim().is_empty() {
        String::new()
    } else {
        format!("exit {:?}: {findings}", out.status.code())
    }
}

/// The rendered sample lines of one series (`name` exactly, any labels).
fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .collect()
}

#[test]
fn promtool_rejects_a_series_without_help() {
    // The check this file relies on does find what the issue saw.
    let findings = promtool_findings("# TYPE timeoutd_x_total counter\ntimeoutd_x_total 1\n");
    assert!(findings.contains("no help text"), "{findings}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_scrape_passes_promtool_with_every_series_at_zero_from_the_start() {
    let env = TestEnv::new().await;
    let d = Daemon::spawn("timeoutd", env.env_vars(&env.config())).await;
    assert!(d.ready_is(200, Duration::from_secs(30)).await, "ready");
    let first = d.metrics().await;
    assert_eq!(
        promtool_findings(&first),
        "",
        "scrape before any record:\n{first}"
    );
    // Each counter, histogram and known label value is there; no record exists yet, so every
    // counter is 0 (histograms may already hold the idle claims' durations).
    for s in SERIES.iter().filter(|s| s.start == Start::Zero) {
        let name = match s.kind {
            Kind::Histogram => format!("{}_count", s.name),
            _ => s.name.to_string(),
        };
        let lines: Vec<String> = match s.label {
            None => vec![name],
            Some((label, values)) => values
                .iter()
                .map(|v| format!("{name}{{{label}=\"{v}\"}}"))
                .collect(),
        };
        for line in lines {
            let value = first
                .lines()
                .find_map(|l| l.strip_prefix(&line)?.strip_prefix(' '));
            assert!(
                value.is_some(),
                "{line} is exported from the start:\n{first}"
            );
            if s.kind == Kind::Counter {
                assert_eq!(value, Some("0"), "{line}");
            }
        }
    }
    for s in SERIES {
        let help = format!("# HELP {} {}", s.name, s.help);
        let present = !samples(&first, s.name).is_empty()
            || !samples(&first, &format!("{}_count", s.name)).is_empty();
        assert!(!present || first.contains(&help), "{help}");
    }

    // After real dispatches (histograms with observations, counters moved) it still passes.
    let counter = DeliveryCounter::start(&env.queue).await;
    env.insert_due(20).await;
    assert!(counter.wait_total(20, Duration::from_secs(60)).await);
    let after = d.idle_metrics().await;
    assert_eq!(
        promtool_findings(&after),
        "",
        "scrape after dispatch:\n{after}"
    );
    assert_eq!(
        common::fleet::series(&after, "timeoutd_dispatched_total"),
        20.0
    );
    d.stop().await;
    counter.close().await;
    env.cleanup().await;
}

/// Every name the code records (`counter!("timeoutd_...")`, `gauge!`, `histogram!`) is in
/// `SERIES`, so it has HELP text.
#[test]
fn every_recorded_series_is_described() {
    let mut files = Vec::new();
    let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut missing = Vec::new();
    let mut seen = 0;
    for path in files {
        let text = std::fs::read_to_string(&path).expect("read");
        for (i, _) in text.match_indices("!(") {
            let Some(name) = text[i + 2..].trim_start().strip_prefix("\"timeoutd_") else {
                continue;
            };
            seen += 1;
            let name: String = "timeoutd_"
                .chars()
                .chain(
                    name.chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_'),
                )
                .collect();
            if !SERIES.iter().any(|s| s.name == name) {
                missing.push(format!("{}: {name}", path.display()));
            }
        }
    }
    assert!(seen >= 15, "found only {seen} metric macro calls in src/");
    assert!(missing.is_empty(), "no HELP text for {missing:?}");
}

#[test]
fn series_names_follow_prometheus_conventions() {
    let mut names: Vec<_> = SERIES.iter().map(|s| s.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), SERIES.len(), "a name is listed twice");
    for s in SERIES {
        assert!(s.name.starts_with("timeoutd_"), "{}", s.name);
        assert_eq!(
            s.kind == Kind::Counter,
            s.name.ends_with("_total"),
            "{}",
            s.name
        );
        assert!(!s.help.is_empty() && s.help.ends_with('.'), "{}", s.name);
    }
}

/// The metrics table of docs/operations.md lists every series with the HELP text the code exports.
#[test]
fn readme_metrics_table_matches_the_help_text() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
            .expect("docs/operations.md");
    for s in SERIES {
        let row = readme.lines().find(|l| {
            l.strip_prefix(&format!("| `{}", s.name))
                .is_some_and(|rest| rest.starts_with('`') || rest.starts_with('{'))
        });
        let row = row.unwrap_or_else(|| panic!("docs/operations.md has no row for {}", s.name));
        assert!(
            row.contains(s.help),
            "docs/operations.md row of {} says {row}",
            s.name
        );
        if let Some((label, values)) = s.label {
            assert!(row.contains(&format!("{{{label}}}")), "{row}");
            for v in values {
                assert!(row.contains(&format!("`{v}`")), "{row} lacks {v}");
            }
        }
    }
}
