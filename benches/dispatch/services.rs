//! The processes a run starts: the test MongoDB (`secantusd-rs`) and `timeoutd run`, and
//! what is read from them (`/metrics`, peak RSS).

use super::*;

pub(crate) struct Secantus {
    pub(crate) uri: String,
    pub(crate) version: String,
    pub(crate) child: std::process::Child,
    pub(crate) _dir: tempfile::TempDir,
}

pub(crate) fn start_secantus() -> Result<Secantus> {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().context("temp dir for secantusd-rs")?;
    let version = std::process::Command::new("secantusd-rs")
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.lines().next().unwrap_or("").trim().to_string()
        })
        .unwrap_or_default();
    let mut cmd = std::process::Command::new("secantusd-rs");
    cmd.args(["--port", "0", "--log-level", "WARNING", "--storage-path"])
        .arg(dir.path())
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context(
        "cannot start secantusd-rs: run scripts/install-test-mongodb.sh, or set TIMEOUTD_BENCH_MONGODB_URI",
    )?;
    let stdout = child.stdout.take().context("secantusd-rs stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix("secantusd-rs listening on ") {
                let _ = tx.send(format!("mongodb://{}/", addr.trim()));
                break;
            }
        }
        for _ in lines {}
    });
    let uri = rx
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| anyhow!("secantusd-rs did not report a listening port within 60 s"))?;
    Ok(Secantus {
        uri,
        version,
        child,
        _dir: dir,
    })
}

pub(crate) struct Daemon {
    pub(crate) child: tokio::process::Child,
    pub(crate) pid: u32,
    pub(crate) port: u16,
    pub(crate) log: PathBuf,
}

pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub(crate) fn daemon_env(ctx: &Ctx, db: &str, port: u16) -> Vec<(String, String)> {
    let mut env = vec![
        ("TIMEOUTD_MONGODB__URI".to_string(), ctx.mongo_uri.clone()),
        ("TIMEOUTD_MONGODB__DATABASE".into(), db.to_string()),
        ("TIMEOUTD_RABBITMQ__URI".into(), ctx.amqp_uri.clone()),
        ("TIMEOUTD_HTTP__LISTEN".into(), format!("127.0.0.1:{port}")),
        ("TIMEOUTD_LOG__LEVEL".into(), "warn".into()),
    ];
    for (key, default) in [
        ("TIMEOUTD_DISPATCH__POLL_INTERVAL", "1s"),
        ("TIMEOUTD_DISPATCH__BATCH_SIZE", "500"),
        // The one shape the collection holds: "auto" would also serve shapes not there.
        ("TIMEOUTD_MONGODB__TIME_ENCODING", ctx.shape.encoding_key()),
        (
            "TIMEOUTD_MONGODB__UUID_REPRESENTATION",
            ctx.shape.uuids_key(),
        ),
    ] {
        if std::env::var(key).is_err() {
            env.push((key.into(), default.into()));
        }
    }
    env
}

impl Daemon {
    pub(crate) async fn spawn(ctx: &Ctx, db: &str, name: &str) -> Result<Self> {
        Self::spawn_with(ctx, db, name, &[]).await
    }

    /// [`Daemon::spawn`] with more `TIMEOUTD_*` variables (the `history` scenario).
    pub(crate) async fn spawn_with(
        ctx: &Ctx,
        db: &str,
        name: &str,
        extra: &[(String, String)],
    ) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let port = free_port()?;
        let log = ctx.work.path().join(format!("{name}.log"));
        let log_file = std::fs::File::create(&log)?;
        let mut env = daemon_env(ctx, db, port);
        env.extend(extra.iter().cloned());
        let mut cmd = std::process::Command::new(&ctx.bin);
        cmd.arg("run")
            // Not the repository: config/timeoutd.toml must not apply.
            .current_dir(ctx.work.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", ctx.bin.display()))?;
        let pid = child.id().context("daemon pid")?;
        let mut captured = ctx.effective_config.lock().expect("lock");
        if captured.is_none() {
            let out = std::process::Command::new(&ctx.bin)
                .arg("check-config")
                .current_dir(ctx.work.path())
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .output()?;
            *captured = Some(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        Ok(Self {
            child,
            pid,
            port,
            log,
        })
    }

    /// An error (with the end of its log) if the process has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "timeoutd (pid {}) exited early with {status}; log:\n{}",
                self.pid,
                log_tail(&self.log)
            );
        }
        Ok(())
    }

    /// Peak resident set size so far, in MiB (`VmHWM`).
    pub(crate) fn peak_rss_mib(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    }

    pub(crate) async fn metrics(&self) -> Option<String> {
        http_get(self.port, "/metrics").await.ok()
    }

    /// SIGTERM, then waits for the drain to finish; returns the exit status and seconds.
    pub(crate) async fn stop(mut self) -> Result<Value> {
        let started = Instant::now();
        // SAFETY: plain kill(2) on a child this process spawned and has not reaped.
        unsafe {
            libc::kill(self.pid as i32, libc::SIGTERM);
        }
        let status = tokio::time::timeout(Duration::from_secs(40), self.child.wait()).await;
        let warnings = std::fs::read_to_string(&self.log)
            .map(|l| l.lines().count())
            .unwrap_or(0);
        match status {
            Ok(Ok(s)) => Ok(json!({
                "exit": s.code(),
                "stop_seconds": started.elapsed().as_secs_f64(),
                "log_lines_at_warn": warnings,
            })),
            _ => {
                let _ = self.child.kill().await;
                bail!("timeoutd (pid {}) did not stop within 40 s", self.pid)
            }
        }
    }
}

pub(crate) fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

pub(crate) async fn http_get(port: u16, path: &str) -> Result<String> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or(text))
}

/// Sum of every series named `name` (any labels) in Prometheus text.
pub(crate) fn prom_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.trim().parse::<f64>().ok())?
        })
        .fold(0.0, |a, b| a + b)
}

/// The value of the series `name{label="value"}` in Prometheus text (0 when absent).
pub(crate) fn prom_labelled(text: &str, name: &str, label: &str, value: &str) -> f64 {
    let prefix = format!("{name}{{");
    let wanted = format!("{label}=\"{value}\"");
    text.lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(&wanted))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// Cumulative buckets `(le, count)` of a histogram, ascending.
pub(crate) fn prom_buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut b: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let v = l.rsplit_once(' ')?.1.trim().parse().ok()?;
            Some((le, v))
        })
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    b
}

/// The upper bound of the bucket holding quantile `q`.
pub(crate) fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

/// Where each record's time went, in ms, from the daemons' own histograms summed over
/// instances: the time each step's calls took, divided by the records, and the rest of the
/// instances' wall time. Steps overlap (removals run beside claims and waves), so the rest is
/// idle when positive and the overlap when negative; the parts add up to the wall time per
/// record either way. `background` (the monitor, census, reaper and shape probe, which run
/// beside the dispatch path) is given apart from that sum.
pub(crate) fn breakdown(texts: &[String], wall_s: f64, records: u64) -> Value {
    let call = |c: &str| {
        texts.iter().fold(0.0, |a, t| {
            a + prom_labelled(t, "timeoutd_mongodb_call_seconds_sum", "call", c)
        })
    };
    let publish = texts.iter().fold(0.0, |a, t| {
        a + prom_sum(t, "timeoutd_publish_confirm_seconds_sum")
    });
    let per = |s: f64| s * 1000.0 / records.max(1) as f64;
    let mut parts = serde_json::Map::new();
    let mut busy = 0.0;
    for c in ["find", "claim", "read_back", "remove", "release"] {
        let s = call(c);
        busy += s;
        parts.insert(c.to_string(), json!(per(s)));
    }
    busy += publish;
    parts.insert("publish_confirm".into(), json!(per(publish)));
    let wall = wall_s * texts.len() as f64;
    parts.insert("rest".into(), json!(per(wall - busy)));
    parts.insert("wall".into(), json!(per(wall)));
    // Beside the dispatch path, so not part of the sum above: the monitor's backlog gauges,
    // the census, the reaper and the shape probe, the database time timeoutd spends besides
    // the lease protocol.
    let mut background = 0.0;
    for c in timeoutd::metrics::BACKGROUND_CALLS {
        let s = call(c);
        background += s;
        parts.insert(format!("bg_{c}"), json!(per(s)));
        let calls = texts.iter().fold(0.0, |a, t| {
            a + prom_labelled(t, "timeoutd_mongodb_call_seconds_count", "call", c)
        });
        parts.insert(format!("bg_{c}_calls"), json!(calls));
    }
    parts.insert("background".into(), json!(per(background)));
    Value::Object(parts)
}

/// What the daemons' own metrics say, summed over instances, and where a batch's time goes.
pub(crate) fn daemon_metrics(texts: &[String], wall_s: f64, records: u64) -> Value {
    let sum = |name: &str| texts.iter().fold(0.0, |a, t| a + prom_sum(t, name));
    let claims = sum("timeoutd_claim_duration_seconds_count");
    let claim_s = sum("timeoutd_claim_duration_seconds_sum");
    let publishes = sum("timeoutd_publish_confirm_seconds_count");
    let publish_s = sum("timeoutd_publish_confirm_seconds_sum");
    let per = |total: f64, n: f64| if n > 0.0 { total / n * 1000.0 } else { 0.0 };
    // Lateness as the daemon measured it (confirm minus due, server clock), bucket bounds.
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for t in texts {
        for (le, c) in prom_buckets(t, "timeoutd_dispatch_lateness_seconds") {
            match buckets.iter_mut().find(|(l, _)| *l == le) {
                Some(b) => b.1 += c,
                None => buckets.push((le, c)),
            }
        }
    }
    buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
    let bound_ms = |q| bucket_quantile(&buckets, q).map(|s| s * 1000.0);
    json!({
        "scraped_instances": texts.len(),
        "claimed_total": sum("timeoutd_claimed_total"),
        "dispatched_total": sum("timeoutd_dispatched_total"),
        "removed_total": sum("timeoutd_removed_total"),
        "lease_lost_total": sum("timeoutd_lease_lost_total"),
        "publish_failures_total": sum("timeoutd_publish_failures_total"),
        "released_total": sum("timeoutd_released_total"),
        "claims": claims,
        "claim_seconds_total": claim_s,
        "claim_ms_mean": per(claim_s, claims),
        "published_batches": publishes,
        "publish_confirm_seconds_total": publish_s,
        "publish_confirm_ms_mean_per_batch": per(publish_s, publishes),
        // Per instance: wall time not spent claiming or awaiting confirms (building messages,
        // the guarded deleteMany, pauses between polls, startup).
        "ms_per_record": breakdown(texts, wall_s, records),
        "lateness_confirm_minus_due_ms_bucket_bounds": {
            "p50_at_most": bound_ms(0.5),
            "p99_at_most": bound_ms(0.99),
        },
    })
}

/// CPU time of one process so far, in seconds (`utime + stime` of `/proc/PID/stat`).
pub(crate) fn process_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks > 0.0).then(|| (utime + stime) / ticks)
}

/// Busy and total jiffies of the whole machine (`/proc/stat`).
fn machine_jiffies() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: f64 = v.iter().sum();
    // idle and iowait.
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0.0);
    Some((total - idle, total))
}

/// Which resource a drain saturates: the machine's CPU, the database server's, timeoutd's.
pub(crate) struct CpuUse {
    mongo_pid: Option<u32>,
    mongo_before: Option<f64>,
    machine_before: Option<(f64, f64)>,
}

impl CpuUse {
    pub(crate) fn start(mongo_pid: Option<u32>) -> Self {
        Self {
            mongo_pid,
            mongo_before: mongo_pid.and_then(process_cpu_s),
            machine_before: machine_jiffies(),
        }
    }

    /// Cores used on average over `wall_s`: the machine's busy share, MongoDB (when the
    /// bench started it) and each timeoutd process (its whole life, which is the drain).
    pub(crate) fn finish(self, wall_s: f64, timeoutd_pids: &[u32]) -> Value {
        let cores = |s: f64| s / wall_s.max(f64::MIN_POSITIVE);
        let machine = self
            .machine_before
            .zip(machine_jiffies())
            .map(|((b0, t0), (b1, t1))| (b1 - b0) / (t1 - t0).max(1.0));
        let mongo = self
            .mongo_pid
            .and_then(process_cpu_s)
            .zip(self.mongo_before)
            .map(|(after, before)| cores(after - before));
        let timeoutd: Vec<f64> = timeoutd_pids
            .iter()
            .filter_map(|p| process_cpu_s(*p).map(cores))
            .collect();
        json!({
            "machine_busy_fraction": machine,
            "machine_cores": std::thread::available_parallelism().map(|n| n.get()).ok(),
            "mongodb_cores": mongo,
            "timeoutd_cores": timeoutd,
        })
    }
}
