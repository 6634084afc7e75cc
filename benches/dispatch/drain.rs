//! `timeoutd-1`, `timeoutd-3`, `rss`: timeoutd processes draining due records; the lateness
//! scenarios, timeoutd's and the baseline's.

use super::*;

/// One or more `timeoutd run` processes draining `n` due records.
pub(crate) async fn scenario_timeoutd_drain(
    ctx: &Ctx,
    scen: &Scen,
    key: &str,
    n: u64,
    instances: usize,
) -> Result<Row> {
    drain_with(ctx, scen, key, n, instances, &[]).await
}

/// [`scenario_timeoutd_drain`] with more `TIMEOUTD_*` variables for the daemons.
pub(crate) async fn drain_with(
    ctx: &Ctx,
    scen: &Scen,
    key: &str,
    n: u64,
    instances: usize,
    extra: &[(String, String)],
) -> Result<Row> {
    // timeoutd's indexes exist before the records do, so that no instance builds them on a
    // full collection inside the timed window.
    let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
    store.ensure_indexes().await?;
    let (expected, insert_s) = insert_records(scen, n, true, due_in_past(n)).await?;
    let expected = Arc::new(expected);
    let counter = live_counter(ctx, &scen.queue, &expected).await?;
    let cpu = CpuUse::start(ctx.mongo_pid);
    let started = Instant::now();
    let started_us = now_us();
    let mut daemons = Vec::new();
    for i in 0..instances {
        daemons.push(Daemon::spawn_with(ctx, &scen.db, &format!("{key}-{i}"), extra).await?);
    }
    let outcome = wait_drained(&scen.coll, n, counter.as_ref(), || {
        daemons.iter_mut().try_for_each(Daemon::check_alive)
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let pids: Vec<u32> = daemons.iter().map(|d| d.pid).collect();
    let cpu = cpu.finish(seconds, &pids);
    // Read before SIGTERM: the peak of the drain, and the daemons' own counters.
    let rss: Vec<f64> = daemons.iter().filter_map(Daemon::peak_rss_mib).collect();
    let mut texts = Vec::new();
    for d in &daemons {
        if let Some(t) = d.metrics().await {
            texts.push(t);
        }
    }
    let mut stops = Vec::new();
    for d in daemons {
        stops.push(d.stop().await.unwrap_or_else(|e| json!(e.to_string())));
    }
    outcome?;
    let received = collect(
        ctx,
        &scen.queue,
        n,
        &expected,
        counter,
        Duration::from_millis(500),
    )
    .await?;
    let first_delivery_s = received
        .first
        .iter()
        .map(|(_, at)| *at)
        .min()
        .map(|at| (at - started_us) as f64 / 1e6);
    let peak = rss.iter().copied().fold(f64::NAN, f64::max);
    Ok(Row {
        scenario: key.into(),
        description: format!(
            "{instances} timeoutd process{} draining {n} due records",
            if instances == 1 { "" } else { "es" }
        ),
        records: n,
        seconds: Some(seconds),
        records_per_s: Some(n as f64 / seconds),
        duplicates: Some(received.duplicates),
        peak_rss_mib: Some(peak),
        details: json!({
            "instances": instances,
            "insert_seconds": insert_s,
            "first_delivery_after_spawn_seconds": ctx.live.then_some(first_delivery_s).flatten(),
            "steady_records_per_s": ctx.live.then(|| steady_rate(&received, n)).flatten(),
            "unexpected_deliveries": received.unexpected,
            "peak_rss_mib_per_instance": rss,
            "cpu": cpu,
            "daemon_metrics": daemon_metrics(&texts, seconds, n),
            "stop": stops,
        }),
        ..Row::default()
    })
}

/// Records per second between the first and the last delivery (startup excluded).
pub(crate) fn steady_rate(received: &Received, n: u64) -> Option<f64> {
    let first = received.first.iter().map(|(_, at)| *at).min()?;
    let span = (received.last_us - first) as f64 / 1e6;
    (span > 0.0).then(|| (n.saturating_sub(1)) as f64 / span)
}

/// Records due uniformly over the window at 500/s, fired by timeoutd (one instance) or the
/// baseline, both polling every second.
pub(crate) async fn scenario_lateness(ctx: &Ctx, scen: &Scen, timeoutd: bool) -> Result<Row> {
    let window_s = (LATENESS_WINDOW_S * ctx.scale).max(2.0);
    let n = (window_s * LATENESS_RATE).round() as u64;
    let poll = Duration::from_secs(1);
    let mut v7 = None;
    if timeoutd {
        let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
        store.ensure_indexes().await?;
    } else {
        v7 = Some(start_v7(ctx, scen, poll).await?);
    }
    // The first record falls due well after the inserts and the process start.
    let lead_ms = 2_500 + n as i64 / 10;
    let first_due = now_ms() + lead_ms;
    let step_us = 1e6 / LATENESS_RATE;
    let (expected, insert_s) = insert_records(scen, n, true, |i| {
        first_due + ((i as f64 * step_us) / 1000.0).round() as i64
    })
    .await?;
    let inserted_before_first_due_ms = first_due - now_ms();
    let expected = Arc::new(expected);
    let counter = Counter::start(ctx, &scen.queue, expected.clone()).await?;
    let started = Instant::now();
    let stop = CancellationToken::new();
    let mut daemon = None;
    let mut task = None;
    if timeoutd {
        daemon = Some(Daemon::spawn(ctx, &scen.db, "lateness").await?);
    } else if let Some((poller, _)) = &v7 {
        let poller = poller.clone();
        let s = stop.clone();
        task = Some(tokio::spawn(async move { poller.run(s).await }));
    }
    let outcome = async {
        counter
            .wait_for(n, || match (daemon.as_mut(), task.as_ref()) {
                (Some(d), _) => d.check_alive(),
                (None, Some(t)) if t.is_finished() => bail!("the baseline poller stopped early"),
                _ => Ok(()),
            })
            .await?;
        wait_empty(&scen.coll, Duration::from_secs(60)).await
    }
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let mut details = json!({
        "window_seconds": window_s,
        "rate_per_s": LATENESS_RATE,
        "poll_interval_seconds": poll.as_secs_f64(),
        "insert_seconds": insert_s,
        "inserted_ms_before_first_due": inserted_before_first_due_ms,
        "measured_as": "consumer receive instant minus due instant (host clock)",
    });
    let mut stats = None;
    if let Some(d) = daemon {
        let texts: Vec<String> = d.metrics().await.into_iter().collect();
        details["daemon_metrics"] = daemon_metrics(&texts, seconds, n);
        details["stop"] = d.stop().await.unwrap_or_else(|e| json!(e.to_string()));
    }
    stop.cancel();
    if let Some(t) = task {
        stats = Some(t.await.map_err(|e| anyhow!("baseline task: {e}"))??);
    }
    if let Some((_, conn)) = v7 {
        let _ = conn.close(200, "done".into()).await;
    }
    let received = counter.finish(Duration::from_millis(300)).await?;
    outcome?;
    if let Ok(dir) = std::env::var("TIMEOUTD_BENCH_DUMP_DIR") {
        let path = Path::new(&dir).join(format!("{}.csv", scen_key(timeoutd)));
        details["dump"] = json!(path.display().to_string());
        dump_lateness(&path, &received, &expected)?;
    }
    if let Some(s) = stats {
        details["v7"] = json!(s);
    }
    Ok(Row {
        scenario: scen_key(timeoutd).into(),
        description: format!(
            "{n} records due uniformly over {window_s:.0} s at {LATENESS_RATE:.0}/s, poll 1 s, {}",
            if timeoutd {
                "one timeoutd process"
            } else {
                "v7 baseline"
            }
        ),
        records: n,
        seconds: Some(seconds),
        records_per_s: Some(n as f64 / seconds),
        duplicates: Some(received.duplicates),
        lateness_ms: Some(lateness(&received, &expected)),
        details,
        ..Row::default()
    })
}

pub(crate) fn scen_key(timeoutd: bool) -> &'static str {
    if timeoutd {
        "lateness-timeoutd"
    } else {
        "lateness-baseline"
    }
}

/// One line per record: due instant (Unix ms), receive instant (Unix µs), lateness (ms).
pub(crate) fn dump_lateness(path: &Path, received: &Received, expected: &Expected) -> Result<()> {
    use std::fmt::Write;
    let mut out = String::from("due_ms,received_us,late_ms\n");
    for (id, at) in &received.first {
        if let Some(due) = expected.get(id) {
            let _ = writeln!(out, "{due},{at},{:.3}", *at as f64 / 1000.0 - *due as f64);
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, out)?;
    Ok(())
}
