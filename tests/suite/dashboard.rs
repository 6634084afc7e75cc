//! The Grafana dashboard config/grafana/timeoutd.json: valid against Grafana's published
//! schema (scripts/validate-grafana-dashboard.mjs with @grafana/schema, installed by
//! scripts/install-grafana-validator.sh), and it shows what the issue lists for every
//! instance without a query to write: each query filtered by the job, namespace and instance
//! variables (so that two fleets under one Prometheus are shown apart), each metric one
//! timeoutd exports, panels that do not overlap.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::repo;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use timeoutd::metrics::SERIES;

const DASHBOARD: &str = "config/grafana/timeoutd.json";

fn dashboard() -> Value {
    serde_json::from_str(&std::fs::read_to_string(repo(DASHBOARD)).unwrap()).unwrap()
}

/// Runs the validator on `paths`: (success, its output).
fn validate(paths: &[&Path]) -> (bool, String) {
    let out = Command::new("node")
        .arg(repo("scripts/validate-grafana-dashboard.mjs"))
        .args(paths)
        .output()
        .expect("node: run scripts/install-grafana-validator.sh");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Every panel, rows' panels included.
fn panels(d: &Value) -> Vec<Value> {
    let mut all = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        all.push(p.clone());
        if let Some(inner) = p["panels"].as_array() {
            all.extend(inner.iter().cloned());
        }
    }
    all
}

/// (panel title, expr) of every query.
fn queries(d: &Value) -> Vec<(String, String)> {
    panels(d)
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            p["targets"].as_array().into_iter().flatten().map(move |t| {
                (
                    title.clone(),
                    t["expr"].as_str().unwrap_or_default().to_string(),
                )
            })
        })
        .collect()
}

#[test]
fn the_dashboard_validates_against_grafanas_schema() {
    let (ok, text) = validate(&[&repo(DASHBOARD)]);
    assert!(ok, "{DASHBOARD} does not validate:\n{text}");
    assert!(
        text.starts_with("ok: ") && text.contains("strict"),
        "{text}"
    );

    // The validator must reject what Grafana's schema does: a copy per mistake.
    let original = std::fs::read_to_string(repo(DASHBOARD)).unwrap();
    let broken = [
        // (replace, with, what the validator must say)
        (
            "\"gridPos\"",
            "\"gridPoss\"",
            "'\"gridPoss\"' does not exist",
        ),
        (
            "\"schemaVersion\": 39",
            "\"schemaVersion\": \"39\"",
            "schemaVersion",
        ),
        (
            "\"drawStyle\": \"line\"",
            "\"drawStyle\": \"lines\"",
            "\"lines\"",
        ),
        (
            "\"type\": \"heatmap\"",
            "\"type\": \"heatmapp\"",
            "no schema for panel type heatmapp",
        ),
        (
            "\"legendFormat\"",
            "\"legendFromat\"",
            "'\"legendFromat\"' does not exist",
        ),
        (
            "\"showLegend\": true",
            "\"showLegend\": \"yes\"",
            "showLegend",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let mut copies = Vec::new();
    for (i, (from, to, _)) in broken.iter().enumerate() {
        assert!(
            original.contains(from),
            "{DASHBOARD} no longer contains {from}"
        );
        let copy = tmp.path().join(format!("broken{i}.json"));
        std::fs::write(&copy, original.replacen(from, to, 1)).unwrap();
        copies.push(copy);
    }
    let paths: Vec<&Path> = copies.iter().map(PathBuf::as_path).collect();
    let (ok, text) = validate(&paths);
    assert!(!ok, "the validator accepted broken dashboards:\n{text}");
    for ((_, to, message), copy) in broken.iter().zip(&copies) {
        let prefix = format!("{}: ", copy.display());
        assert!(
            text.lines()
                .any(|l| l.starts_with(&prefix) && l.contains(message)),
            "{to} was not rejected with {message:?}:\n{text}"
        );
    }
}

#[test]
fn every_query_follows_the_fleet_and_instance_variables_and_the_data_source() {
    let d = dashboard();
    let vars = d["templating"]["list"].as_array().expect("variables");
    for name in ["job", "namespace", "instance"] {
        let var = vars
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no {name} variable"));
        assert_eq!(var["type"], "query", "{name}");
        assert_eq!(var["multi"], true, "{name}");
        assert_eq!(var["includeAll"], true, "{name}");
        // All matches a series without the label too (systemd hosts have no namespace).
        assert_eq!(var["allValue"], ".*", "{name}");
        assert!(
            var["query"]["query"]
                .as_str()
                .is_some_and(|q| q.starts_with("label_values(timeoutd_build_info")),
            "{name}: {}",
            var["query"]
        );
    }
    // Each variable offers the values of the fleets the ones before it select.
    let query = |name: &str| {
        vars.iter().find(|v| v["name"] == name).expect("variable")["query"]["query"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert!(query("namespace").contains("job=~\"$job\""));
    assert!(query("instance").contains("job=~\"$job\", namespace=~\"$namespace\""));
    assert!(
        vars.iter()
            .any(|v| v["name"] == "datasource" && v["type"] == "datasource")
    );
    for p in panels(&d).iter().filter(|p| p["type"] != "row") {
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        }
    }
    for (title, expr) in queries(&d) {
        for var in ["job", "namespace", "instance"] {
            let matcher = format!("{var}=~\"${var}\"");
            assert!(
                expr.matches("timeoutd_").count() == expr.matches(&matcher).count(),
                "{title}: {expr}: a series without {matcher}"
            );
        }
    }
}

/// The `timeoutd_*` metric names a PromQL expression uses.
pub fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (i, _) in expr.match_indices("timeoutd_") {
        if i > 0 && expr[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = expr[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.push(name);
    }
    names
}

#[test]
fn the_dashboard_shows_what_the_issue_lists_with_metrics_timeoutd_exports() {
    let d = dashboard();
    let all = queries(&d);
    for (title, expr) in &all {
        for name in metric_names(expr) {
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(
                SERIES.iter().any(|s| s.name == base),
                "{title}: {name} is not a series timeoutd exports"
            );
        }
    }
    let shown = |needle: &str| all.iter().any(|(_, e)| e.contains(needle));
    for needle in [
        "rate(timeoutd_dispatched_total",
        "histogram_quantile(0.99, sum by (le) (rate(timeoutd_dispatch_lateness_seconds_bucket",
        "timeoutd_due_backlog",
        "timeoutd_oldest_due_age_seconds",
        "timeoutd_leases_held",
        "timeoutd_lease_lost_total",
        "timeoutd_possible_duplicates_total",
        "timeoutd_retries_total",
        "timeoutd_parked_total",
        "sum by (reason) (increase(timeoutd_publish_failures_total",
        "timeoutd_dependency_up",
        "timeoutd_clock_offset_seconds",
        "timeoutd_claim_duration_seconds_bucket",
        "timeoutd_publish_confirm_seconds_bucket",
    ] {
        assert!(shown(needle), "no panel shows {needle}");
    }
    assert!(
        panels(&d).iter().any(|p| p["type"] == "heatmap"),
        "lateness as a heatmap"
    );
}

#[test]
fn panels_do_not_overlap() {
    let d = dashboard();
    let boxes: Vec<(String, [i64; 4])> = panels(&d)
        .iter()
        .map(|p| {
            let g = &p["gridPos"];
            let n = |k: &str| g[k].as_i64().expect("gridPos");
            (
                p["title"].as_str().unwrap_or_default().to_string(),
                [n("x"), n("y"), n("w"), n("h")],
            )
        })
        .collect();
    for (i, (a, [ax, ay, aw, ah])) in boxes.iter().enumerate() {
        assert!(ax + aw <= 24, "{a} is wider than the grid");
        for (b, [bx, by, bw, bh]) in &boxes[i + 1..] {
            let apart = ax + aw <= *bx || bx + bw <= *ax || ay + ah <= *by || by + bh <= *ay;
            assert!(apart, "{a} and {b} overlap");
        }
    }
}
