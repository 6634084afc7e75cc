//! The alerting rules as Prometheus judges them: `promtool check rules` accepts
//! config/prometheus/timeoutd-rules.yml, `promtool test rules` passes its unit tests, every
//! alert is tested both firing and quiet, carries a severity, a summary and a description,
//! has a runbook section its `runbook_url` points at, every rule groups by the labels that
//! tell fleets apart, and the Kubernetes PrometheusRule holds the same groups.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::repo;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs promtool; (success, stdout + stderr).
fn promtool(args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (Debian's prometheus package): run scripts/install-prometheus.sh");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

const RULES: &str = "config/prometheus/timeoutd-rules.yml";
const RULE_TESTS: &str = "config/prometheus/timeoutd-rules.test.yml";
/// Where every alert's `runbook_url` points, followed by `#<alert name in lower case>`: one
/// place, documented at the top of the rules file (a fork replaces it there and in the
/// PrometheusRule).
const RUNBOOK_BASE: &str = "https://github.com/OWNER/timeoutd/blob/main/docs/operations.md";
/// The labels that tell two fleets under one Prometheus apart.
const FLEET_LABELS: [&str; 2] = ["job", "namespace"];

/// The runbook document: docs/operations.md once the README is split into docs/, else the
/// README.
fn runbook_document() -> (PathBuf, String) {
    let path = [repo("docs/operations.md"), repo("README.md")]
        .into_iter()
        .find(|p| p.exists())
        .expect("neither docs/operations.md nor README.md");
    let text = std::fs::read_to_string(&path).unwrap();
    (path, text)
}

/// The section under the heading (any level) `name`, up to the next heading.
fn section<'a>(doc: &'a str, name: &str) -> Option<&'a str> {
    let mut lines = doc.split_inclusive('\n');
    let start = lines.position(|l| {
        let t = l.trim_end();
        t.starts_with('#') && t.trim_start_matches('#').trim() == name
    })?;
    let offset: usize = doc
        .split_inclusive('\n')
        .take(start + 1)
        .map(str::len)
        .sum();
    let rest = &doc[offset..];
    let end = rest.find("\n#").map_or(rest.len(), |i| i + 1);
    Some(&rest[..end])
}

/// GitHub's anchor of a heading: lower case, spaces to dashes, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every alerting rule of the rules file.
fn alerts() -> Vec<Value> {
    let rules = yaml(&repo(RULES));
    let groups = rules["groups"].as_array().expect("groups").clone();
    let alerts: Vec<Value> = groups
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").clone())
        .filter(|r| r.get("alert").is_some())
        .collect();
    assert!(alerts.len() >= 8, "the issue lists at least eight alerts");
    alerts
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    let dir = repo("config/prometheus");
    let (ok, text) = promtool(&["check", "rules", "timeoutd-rules.yml"], &dir);
    assert!(ok, "promtool check rules:\n{text}");
    let expected = format!("SUCCESS: {} rules found", alerts().len());
    assert!(text.contains(&expected), "{text}");
    assert!(
        !text.to_lowercase().contains("warn"),
        "lint findings:\n{text}"
    );

    let (ok, text) = promtool(&["test", "rules", "timeoutd-rules.test.yml"], &dir);
    assert!(ok, "promtool test rules:\n{text}");
    assert!(text.contains("SUCCESS"), "{text}");
}

#[test]
fn the_unit_tests_fail_when_an_alert_would_not_fire() {
    // A copy with one threshold moved out of reach: the tests must notice.
    let tmp = tempfile::tempdir().unwrap();
    let rules = std::fs::read_to_string(repo(RULES)).unwrap();
    let broken = "max by (job, namespace) (timeoutd_oldest_due_age_seconds) > 60";
    assert!(rules.contains(broken), "{RULES} changed: update this test");
    std::fs::write(
        tmp.path().join("timeoutd-rules.yml"),
        rules.replace(
            broken,
            "max by (job, namespace) (timeoutd_oldest_due_age_seconds) > 6000",
        ),
    )
    .unwrap();
    std::fs::copy(repo(RULE_TESTS), tmp.path().join("timeoutd-rules.test.yml")).unwrap();
    let (ok, text) = promtool(&["test", "rules", "timeoutd-rules.test.yml"], tmp.path());
    assert!(!ok, "promtool test rules passed a broken rule:\n{text}");
    assert!(text.contains("TimeoutdDueNotDispatched"), "{text}");
}

#[test]
fn every_alert_is_tested_firing_and_quiet() {
    let tests = yaml(&repo(RULE_TESTS));
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .collect();
    for alert in alerts() {
        let name = alert["alert"].as_str().expect("alert name");
        let of_this: Vec<&&Value> = cases.iter().filter(|c| c["alertname"] == name).collect();
        let fires = of_this
            .iter()
            .any(|c| c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()));
        let quiet = of_this
            .iter()
            .any(|c| c["exp_alerts"].as_array().is_some_and(|a| a.is_empty()));
        assert!(fires, "{name}: no test case where it fires");
        assert!(quiet, "{name}: no test case where it stays quiet");
    }
}

#[test]
fn every_alert_has_severity_summary_description_and_a_runbook() {
    let (doc_path, doc) = runbook_document();
    let headings: Vec<String> = doc
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();
    for alert in alerts() {
        let name = alert["alert"].as_str().expect("alert name");
        let severity = alert["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        let summary = alert["annotations"]["summary"].as_str().unwrap_or_default();
        let description = alert["annotations"]["description"]
            .as_str()
            .unwrap_or_default();
        assert!(!summary.is_empty(), "{name}: no summary");
        assert!(
            description.contains("$value") || description.chars().any(|c| c.is_ascii_digit()),
            "{name}: the description gives no numbers: {description}"
        );
        let section = section(&doc, name)
            .unwrap_or_else(|| panic!("{} has no runbook section {name:?}", doc_path.display()));
        // The runbook one click from the alert: the URL's anchor is that heading.
        let url = alert["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no runbook_url"));
        let (base, fragment) = url
            .split_once('#')
            .unwrap_or_else(|| panic!("{name}: {url} has no #anchor"));
        assert_eq!(base, RUNBOOK_BASE, "{name}: runbook_url {url}");
        assert_eq!(fragment, anchor(name), "{name}: runbook_url {url}");
        assert!(
            headings.iter().any(|h| h == fragment),
            "{name}: no heading in {} has the anchor #{fragment}",
            doc_path.display()
        );
        assert!(
            section.contains("timeoutd ") || section.contains("`/readyz`"),
            "{name}: the runbook names no command to run:\n{section}"
        );
    }
}

#[test]
fn the_prometheus_rule_holds_the_same_groups() {
    let rules = yaml(&repo(RULES));
    let rule = yaml(&repo("config/kubernetes/prometheusrule.yaml"));
    assert_eq!(rule["kind"], "PrometheusRule");
    assert_eq!(
        rule["spec"]["groups"], rules["groups"],
        "config/kubernetes/prometheusrule.yaml differs from {RULES}"
    );
}

/// The aggregations (`sum`, `max`, ...) and `on (...)` matchings of a PromQL expression: for
/// each, the keyword and the label list it names (`None`: no `by`/label list at all).
fn groupings(expr: &str) -> Vec<(String, Option<Vec<String>>)> {
    const AGGREGATIONS: [&str; 12] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !(chars[i].is_ascii_alphabetic() || chars[i] == '_') {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        // `on (...)` keeps the labels it names of both sides; an aggregation keeps only
        // those of its `by (...)` (`without` and a trailing `by` are not used here: refused).
        let is_on = word == "on";
        if !(is_on || AGGREGATIONS.contains(&word.as_str())) {
            continue;
        }
        let rest: String = chars[i..].iter().collect();
        let rest = rest.trim_start();
        let list = if is_on {
            Some(rest)
        } else {
            rest.strip_prefix("by")
        };
        let labels = list.and_then(|l| {
            let l = l.trim_start().strip_prefix('(')?;
            let end = l.find(')')?;
            Some(
                l[..end]
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect(),
            )
        });
        found.push((word, labels));
    }
    found
}

#[test]
fn every_rule_groups_by_the_labels_that_tell_fleets_apart() {
    let mut aggregations = 0;
    for alert in alerts() {
        let name = alert["alert"].as_str().expect("alert name");
        let expr = alert["expr"].as_str().expect("expr");
        for (word, labels) in groupings(expr) {
            aggregations += 1;
            let labels = labels.unwrap_or_else(|| {
                panic!("{name}: `{word}` without `by (...)` merges every fleet: {expr}")
            });
            for fleet in FLEET_LABELS {
                assert!(
                    labels.iter().any(|l| l == fleet),
                    "{name}: `{word} ({})` drops `{fleet}`: {expr}",
                    labels.join(", ")
                );
            }
        }
    }
    assert!(aggregations >= 8, "the parser found only {aggregations}");
    // The parser itself: the old rules' shapes are caught.
    let old = "max(timeoutd_due_backlog) > 0 and on() sum(increase(x[5m])) == 0";
    let found = groupings(old);
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(
        found
            .iter()
            .all(|(_, l)| l.as_ref().is_none_or(|l| l.is_empty()))
    );
    assert!(groupings("max_over_time(x[1h])").is_empty());
}

/// The test group of the unit-test file with this name.
fn test_group(name: &str) -> Value {
    let tests = yaml(&repo(RULE_TESTS));
    tests["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{RULE_TESTS} has no test group named {name:?}"))
        .clone()
}

#[test]
fn two_fleets_one_outage_fires_for_that_fleet_alone() {
    // promtool runs the cases (promtool_accepts_the_rules_and_their_unit_tests_pass); this
    // checks the cases say what the issue asks.
    for name in [
        "an outage in one of two fleets fires for that fleet",
        "a fleet that vanishes beside another fires TimeoutdAbsent for it",
    ] {
        let group = test_group(name);
        let namespaces: std::collections::BTreeSet<String> = group["input_series"]
            .as_array()
            .expect("input_series")
            .iter()
            .filter_map(|s| s["series"].as_str())
            .filter_map(|s| s.split("namespace=\"").nth(1))
            .filter_map(|s| s.split('"').next())
            .map(str::to_string)
            .collect();
        assert_eq!(namespaces.len(), 2, "{name}: two fleets, {namespaces:?}");
        let fired: Vec<&Value> = group["alert_rule_test"]
            .as_array()
            .expect("alert_rule_test")
            .iter()
            .flat_map(|c| c["exp_alerts"].as_array().into_iter().flatten())
            .collect();
        assert!(!fired.is_empty(), "{name}: nothing fires");
        for alert in fired {
            assert_eq!(
                alert["exp_labels"]["namespace"], "orders",
                "{name}: {alert}"
            );
            assert_eq!(alert["exp_labels"]["job"], "timeoutd", "{name}: {alert}");
        }
    }
}

#[test]
fn a_paused_destination_fires_nothing() {
    let group = test_group("a paused destination fires nothing");
    let cases = group["alert_rule_test"]
        .as_array()
        .expect("alert_rule_test");
    for case in cases {
        assert_eq!(
            case["exp_alerts"].as_array().map(Vec::len),
            Some(0),
            "{case}"
        );
    }
    for alert in alerts() {
        let name = alert["alert"].as_str().expect("alert name");
        assert!(
            cases.iter().any(|c| c["alertname"] == name),
            "the paused case does not show that {name} stays quiet"
        );
    }
}
