//! The alerting rules as Prometheus judges them: `promtool check rules` accepts
//! config/prometheus/timeoutd-rules.yml, `promtool test rules` passes its unit tests, every
//! alert is tested both firing and quiet, carries a severity, a summary and a description,
//! has a runbook section in docs/operations.md, and the Kubernetes PrometheusRule holds the same groups.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

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
    let broken = "expr: max(timeoutd_oldest_due_age_seconds) > 60";
    assert!(rules.contains(broken), "{RULES} changed: update this test");
    std::fs::write(
        tmp.path().join("timeoutd-rules.yml"),
        rules.replace(broken, "expr: max(timeoutd_oldest_due_age_seconds) > 6000"),
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
    let readme = std::fs::read_to_string(repo("docs/operations.md")).unwrap();
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
        let heading = format!("#### {name}\n");
        let section = readme
            .split_once(&heading)
            .map(|(_, rest)| rest.split("\n#").next().unwrap_or_default())
            .unwrap_or_else(|| panic!("docs/operations.md has no runbook section {heading:?}"));
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
