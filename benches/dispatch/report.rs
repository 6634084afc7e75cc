//! A run's results: rows, lateness and claim figures, the targets of issues 5 and 13, the
//! printed table and breakdown, and what is recorded of the machine.

use super::*;

#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct LatenessMs {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) min: f64,
    pub(crate) mean: f64,
    pub(crate) samples: usize,
    pub(crate) over_25ms: usize,
    pub(crate) over_100ms: usize,
}

#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct ClaimMs {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) samples: Vec<f64>,
    pub(crate) future_records: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct Row {
    pub(crate) scenario: String,
    pub(crate) description: String,
    pub(crate) records: u64,
    pub(crate) seconds: Option<f64>,
    pub(crate) records_per_s: Option<f64>,
    pub(crate) ratio_to_raw: Option<f64>,
    /// To the database's write floor measured in this run (`floor-write`).
    pub(crate) ratio_to_floor: Option<f64>,
    pub(crate) ratio_to_baseline: Option<f64>,
    pub(crate) duplicates: Option<u64>,
    pub(crate) lateness_ms: Option<LatenessMs>,
    pub(crate) claim_latency_ms: Option<ClaimMs>,
    pub(crate) peak_rss_mib: Option<f64>,
    /// Scenario-specific detail: insert times, time to first delivery, daemon metrics.
    pub(crate) details: Value,
    pub(crate) error: Option<String>,
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub(crate) fn lateness(received: &Received, expected: &Expected) -> LatenessMs {
    let mut late: Vec<f64> = received
        .first
        .iter()
        .filter_map(|(id, at)| {
            expected
                .get(id)
                .map(|due| *at as f64 / 1000.0 - *due as f64)
        })
        .collect();
    late.sort_by(f64::total_cmp);
    let mean = late.iter().fold(0.0, |a, b| a + b) / late.len().max(1) as f64;
    LatenessMs {
        over_25ms: late.iter().filter(|l| **l > 25.0).count(),
        over_100ms: late.iter().filter(|l| **l > 100.0).count(),
        p50: percentile(&late, 0.50),
        p99: percentile(&late, 0.99),
        max: late.last().copied().unwrap_or(f64::NAN),
        min: late.first().copied().unwrap_or(f64::NAN),
        mean,
        samples: late.len(),
    }
}

pub(crate) fn env_parse<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `timeoutd` executable: `TIMEOUTD_BENCH_BIN`, else the one cargo built for this bench.
pub(crate) fn timeoutd_bin() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("TIMEOUTD_BENCH_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = option_env!("CARGO_BIN_EXE_timeoutd") {
        return Ok(PathBuf::from(p));
    }
    // target/<profile>/deps/dispatch-HASH -> target/<profile>/timeoutd
    let exe = std::env::current_exe()?;
    let candidate = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("timeoutd"))
        .context("no target directory")?;
    if candidate.exists() {
        Ok(candidate)
    } else {
        bail!(
            "{} not found: run `cargo build --release` first, or set TIMEOUTD_BENCH_BIN",
            candidate.display()
        )
    }
}

pub(crate) fn machine_info() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string());
    let mem_total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(str::to_string));
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "model_name": model,
        "mem_total": mem_total,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string()),
    })
}

pub(crate) fn loadavg() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

pub(crate) fn rabbitmq_version(amqp_uri: &str) -> Option<String> {
    let local = amqp_uri.contains("@127.0.0.1") || amqp_uri.contains("@localhost");
    if !local {
        return None;
    }
    let out = std::process::Command::new("timeout")
        .args(["15", "rabbitmqctl", "version"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !v.is_empty()).then_some(v)
}

#[derive(Debug, Serialize)]
pub(crate) struct Target {
    pub(crate) target: String,
    pub(crate) measured: String,
    pub(crate) pass: Option<bool>,
}

pub(crate) fn targets(rows: &[Row]) -> Vec<Target> {
    let row = |k: &str| rows.iter().find(|r| r.scenario == k && r.error.is_none());
    let rate = |k: &str| row(k).and_then(|r| r.records_per_s);
    let mut t = Vec::new();
    let mut push = |target: &str, measured: Option<String>, pass: Option<bool>| {
        t.push(Target {
            target: target.into(),
            measured: measured.unwrap_or_else(|| "not measured".into()),
            pass,
        })
    };
    let one = row("timeoutd-1");
    let r = one.and_then(|r| r.ratio_to_floor);
    push(
        "timeoutd-1 >= 0.85x the database write floor",
        r.map(|r| format!("{r:.2}x")),
        r.map(|r| r >= 0.85),
    );
    let r = one.and_then(|r| r.ratio_to_baseline);
    push(
        "timeoutd-1 >= 8x baseline",
        r.map(|r| format!("{r:.1}x")),
        r.map(|r| r >= 8.0),
    );
    let three = row("timeoutd-3");
    let m = rate("timeoutd-3")
        .zip(rate("timeoutd-1"))
        .zip(three.and_then(|r| r.duplicates));
    push(
        "timeoutd-3 >= 0.95x timeoutd-1, zero duplicates",
        m.map(|((a, b), d)| {
            format!(
                "{:.2}x ({a:.0}/s vs {b:.0}/s), {d} duplicates",
                a / b.max(f64::MIN_POSITIVE)
            )
        }),
        m.map(|((a, b), d)| a >= 0.95 * b && d == 0),
    );
    let h = rate("history-on").zip(rate("history-off"));
    push(
        "history on >= 0.90x history off (drain, same run)",
        h.map(|(on, off)| {
            format!(
                "{:.2}x ({on:.0}/s vs {off:.0}/s)",
                on / off.max(f64::MIN_POSITIVE)
            )
        }),
        h.map(|(on, off)| on >= 0.9 * off),
    );
    let l = row("lateness-timeoutd").and_then(|r| r.lateness_ms.clone());
    push(
        "timeoutd lateness p99 <= 25 ms, max <= 100 ms",
        l.as_ref()
            .map(|l| format!("p99 {:.1} ms, max {:.1} ms", l.p99, l.max)),
        l.as_ref().map(|l| l.p99 <= 25.0 && l.max <= 100.0),
    );
    let small = row("claim-small").and_then(|r| r.claim_latency_ms.clone());
    let large = row("claim-large").and_then(|r| r.claim_latency_ms.clone());
    let c = small.zip(large);
    push(
        "claim latency at 1M future <= 2x at 10k",
        c.as_ref().map(|(s, l)| {
            format!(
                "{:.1} ms at {} vs {:.1} ms at {}",
                l.median, l.future_records, s.median, s.future_records
            )
        }),
        c.as_ref().map(|(s, l)| l.median <= 2.0 * s.median),
    );
    let rss = row("rss").and_then(|r| r.peak_rss_mib);
    push(
        "peak RSS <= 64 MiB draining 100k",
        rss.map(|m| format!("{m:.1} MiB")),
        rss.map(|m| m <= 64.0),
    );
    t
}

pub(crate) fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.decimals$}"),
        _ => "-".into(),
    }
}

pub(crate) fn print_table(rows: &[Row], scale: f64, live: bool, shape: Shape) {
    println!();
    println!(
        "timeoutd dispatch benchmark, collection {}, consumer {}, scale {scale}{}",
        shape.describe(),
        if live { "live" } else { "after" },
        if scale < 1.0 {
            " (REDUCED: record counts scaled down)"
        } else {
            ""
        }
    );
    println!(
        "{:<18} {:>8} {:>8} {:>10} {:>7} {:>7} {:>8} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "scenario",
        "records",
        "seconds",
        "records/s",
        "x floor",
        "x raw",
        "x base",
        "dups",
        "late p50",
        "late p99",
        "late max",
        "claim ms",
        "RSS MiB"
    );
    for r in rows {
        if let Some(e) = &r.error {
            println!(
                "{:<18} FAILED: {}",
                r.scenario,
                e.lines().next().unwrap_or("")
            );
            continue;
        }
        let l = r.lateness_ms.as_ref();
        println!(
            "{:<18} {:>8} {:>8} {:>10} {:>7} {:>7} {:>8} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7}",
            r.scenario,
            r.records,
            fmt_opt(r.seconds, 2),
            fmt_opt(r.records_per_s, 0),
            fmt_opt(r.ratio_to_floor, 2),
            fmt_opt(r.ratio_to_raw, 2),
            fmt_opt(r.ratio_to_baseline, 1),
            r.duplicates
                .map(|d| d.to_string())
                .unwrap_or_else(|| "-".into()),
            fmt_opt(l.map(|l| l.p50), 1),
            fmt_opt(l.map(|l| l.p99), 1),
            fmt_opt(l.map(|l| l.max), 1),
            fmt_opt(r.claim_latency_ms.as_ref().map(|c| c.median), 1),
            fmt_opt(r.peak_rss_mib, 1),
        );
    }
    println!();
}

/// Where each record's time went in the drains, from the daemons' own histograms.
pub(crate) fn print_breakdown(rows: &[Row]) {
    let mut any = false;
    for r in rows.iter().filter(|r| r.error.is_none()) {
        let Some(m) = r.details.pointer("/daemon_metrics/ms_per_record") else {
            continue;
        };
        if r.scenario.starts_with("lateness") {
            continue;
        }
        if !any {
            println!(
                "ms per record, from the daemons' metrics (instances' time summed; rest = idle, or overlap when negative; bg = background calls beside these, not in the sum):"
            );
            println!(
                "  {:<12} {:>7} {:>7} {:>9} {:>7} {:>7} {:>9} {:>7} {:>7} {:>7}",
                "scenario",
                "find",
                "claim",
                "read_back",
                "remove",
                "release",
                "pub+conf",
                "rest",
                "wall",
                "bg"
            );
            any = true;
        }
        let f = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        println!(
            "  {:<12} {:>7.4} {:>7.4} {:>9.4} {:>7.4} {:>7.4} {:>9.4} {:>7.4} {:>7.4} {:>7.4}",
            r.scenario,
            f("find"),
            f("claim"),
            f("read_back"),
            f("remove"),
            f("release"),
            f("publish_confirm"),
            f("rest"),
            f("wall"),
            f("background"),
        );
    }
    for r in rows
        .iter()
        .filter(|r| r.scenario == "floor-write" && r.error.is_none())
    {
        let f = |k: &str| r.details.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        println!(
            "  {:<12} {:>7} {:>7.4} {:>9} {:>7.4}",
            r.scenario,
            "-",
            f("update_ms_per_record"),
            "-",
            f("delete_ms_per_record"),
        );
    }
    for r in rows.iter().filter(|r| r.error.is_none()) {
        let Some(c) = r.details.get("cpu") else {
            continue;
        };
        let cores = |k: &str| c.get(k).and_then(Value::as_f64);
        let timeoutd: f64 = c
            .get("timeoutd_cores")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_f64).sum())
            .unwrap_or(f64::NAN);
        println!(
            "  {:<12} cpu: machine {}% busy, MongoDB {} cores, timeoutd {timeoutd:.2} cores in all",
            r.scenario,
            fmt_opt(cores("machine_busy_fraction").map(|f| f * 100.0), 0),
            fmt_opt(cores("mongodb_cores"), 2),
        );
    }
    if any {
        println!();
    }
}

pub(crate) fn print_targets(targets: &[Target]) {
    println!("targets:");
    for t in targets {
        let verdict = match t.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "-   ",
        };
        println!("  {verdict}  {:<48} {}", t.target, t.measured);
    }
    println!();
}
