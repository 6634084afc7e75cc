//! Against a real Prometheus (Debian's `prometheus` package): it scrapes two real timeoutd
//! processes every second while they dispatch real records, and through its HTTP API the
//! targets are up, the summed `timeoutd_dispatched_total` equals what the test's consumer
//! received, every PromQL expression of the dashboard and of the alerting rules parses, every
//! dashboard query returns data, and an unroutable destination (records retried, then parked)
//! makes `TimeoutdRecordsParked` fire from the shipped rules (with `for:` shortened).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;
use crate::repo;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bson::doc;
use common::fleet::{Daemon, DeliveryCounter, vars};
use common::*;
use serde_json::Value;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(120);

/// A real `prometheus` on a free port, killed on drop.
struct Prometheus {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("addr").port()
}

/// The shipped rules with every `for:` cut to 1 s, so a condition shows at once.
fn rules_with_short_for() -> String {
    let rules = std::fs::read_to_string(repo("config/prometheus/timeoutd-rules.yml")).unwrap();
    rules
        .lines()
        .map(|l| match l.split_once("for: ") {
            Some((indent, _)) if indent.trim().is_empty() => format!("{indent}for: 1s"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl Prometheus {
    fn start(targets: &[String]) -> Prometheus {
        let dir = tempfile::tempdir().expect("temp dir");
        let rules = dir.path().join("rules.yml");
        std::fs::write(&rules, rules_with_short_for()).unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - '{}'\n\
             scrape_configs:\n  - job_name: timeoutd\n    static_configs:\n      - targets: [{}]\n",
            rules.display(),
            targets.join(", ")
        );
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let port = free_port();
        let mut cmd = Command::new("prometheus");
        cmd.arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log);
        crate::common::dies_with_the_tests(&mut cmd);
        let child = cmd
            .spawn()
            .expect("prometheus (Debian's package): run scripts/install-prometheus.sh");
        Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// GET `path` with `params`; the JSON body, or None when nothing answers yet.
    async fn get(&self, path: &str, params: Vec<(&'static str, String)>) -> Option<Value> {
        let url = format!("{}{path}", self.base);
        tokio::task::spawn_blocking(move || {
            let agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(10)))
                .build()
                .new_agent();
            let mut req = agent.get(&url);
            for (k, v) in &params {
                req = req.query(*k, v);
            }
            let mut r = req.call().ok()?;
            serde_json::from_str(&r.body_mut().read_to_string().ok()?).ok()
        })
        .await
        .expect("request task")
    }

    /// An instant query's answer (`status`, `data`, or `error`).
    async fn query(&self, expr: &str) -> Value {
        self.get("/api/v1/query", vec![("query", expr.to_string())])
            .await
            .unwrap_or(Value::Null)
    }

    /// The instant vector of `expr`; empty when it has no data (or failed).
    async fn vector(&self, expr: &str) -> Vec<Value> {
        self.query(expr).await["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

/// The dashboard's queries with its variables filled in as Grafana would.
fn dashboard_exprs() -> Vec<(String, String)> {
    let d: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("config/grafana/timeoutd.json")).unwrap(),
    )
    .unwrap();
    let mut panels = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        panels.push(p.clone());
        panels.extend(p["panels"].as_array().into_iter().flatten().cloned());
    }
    panels
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            p["targets"].as_array().into_iter().flatten().map(move |t| {
                let expr = t["expr"]
                    .as_str()
                    .unwrap_or_default()
                    .replace("$instance", ".*")
                    .replace("$namespace", ".*")
                    .replace("$job", ".*")
                    .replace("$__rate_interval", "30s");
                (title.clone(), expr)
            })
        })
        .collect()
}

fn rule_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo("config/prometheus/timeoutd-rules.yml")).unwrap();
    let rules: Value = serde_saphyr::from_str(&text).unwrap();
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .map(|r| {
            (
                r["alert"].as_str().unwrap_or_default().to_string(),
                r["expr"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_counts_and_alerts() {
    let env = TestEnv::new().await;
    let n = 40;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let mut v = vars(&env, &env.config());
    // The unroutable record is refused twice, retried once in between, then parked.
    for (k, val) in [("BASE", "100ms"), ("CAP", "100ms"), ("MAX_ATTEMPTS", "2")] {
        v.push((format!("TIMEOUTD_RETRY__{k}"), val.into()));
    }
    let a = Daemon::spawn("a", v.clone()).await;
    let b = Daemon::spawn("b", v).await;
    let targets: Vec<String> = [&a, &b]
        .iter()
        .map(|d| d.base.trim_start_matches("http://").to_string())
        .collect();
    let prom = Prometheus::start(&targets);

    // Both targets up.
    let up = eventually(WAIT, || async {
        let t = prom
            .get("/api/v1/targets", vec![])
            .await
            .unwrap_or(Value::Null);
        let active = t["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        active.len() == 2 && active.iter().all(|t| t["health"] == "up")
    })
    .await;
    assert!(up, "targets not up; prometheus log:\n{}", prom.log());

    let counter = DeliveryCounter::start(&env.queue).await;
    env.insert_due(n).await;
    env.insert(vec![v7_record(
        Uuid::new_v4(),
        &missing,
        Uuid::new_v4(),
        in_ms(-100),
        doc! {},
    )])
    .await;
    assert!(counter.wait_total(n, WAIT).await, "{n} deliveries");
    counter.settle(Duration::from_secs(1)).await;
    let delivered = counter.total();

    // Prometheus's sum converges on the consumer's count.
    let dispatched = || async {
        prom.vector("sum(timeoutd_dispatched_total)")
            .await
            .first()
            .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
    };
    let converged = eventually(WAIT, || async {
        dispatched().await == Some(delivered as f64)
    })
    .await;
    assert!(
        converged,
        "sum(timeoutd_dispatched_total) = {:?} while the consumer received {delivered}",
        dispatched().await
    );

    // The unroutable record parks; the shipped rule fires on it.
    let fired = eventually(WAIT, || async {
        let alerts = prom
            .get("/api/v1/alerts", vec![])
            .await
            .unwrap_or(Value::Null);
        alerts["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| {
                a["labels"]["alertname"] == "TimeoutdRecordsParked"
                    && a["labels"]["reason"] == "unroutable"
                    && (a["state"] == "firing" || a["state"] == "pending")
            })
    })
    .await;
    assert!(
        fired,
        "TimeoutdRecordsParked did not fire; log:\n{}",
        prom.log()
    );
    let absent = prom.query("ALERTS{alertname=\"TimeoutdAbsent\"}").await;
    assert_eq!(absent["data"]["result"], Value::Array(vec![]), "{absent}");

    // Every expression parses; every dashboard query has data from this scenario.
    for (name, expr) in rule_exprs() {
        let answer = prom.query(&expr).await;
        assert_eq!(answer["status"], "success", "rule {name}: {expr}: {answer}");
    }
    for (title, expr) in dashboard_exprs() {
        let answer = prom.query(&expr).await;
        assert_eq!(
            answer["status"], "success",
            "panel {title}: {expr}: {answer}"
        );
        let has_data = eventually(WAIT, || async { !prom.vector(&expr).await.is_empty() }).await;
        assert!(has_data, "panel {title}: {expr} returned no data");
    }

    drop(prom);
    a.stop().await;
    b.stop().await;
    counter.close().await;
    env.cleanup().await;
}
