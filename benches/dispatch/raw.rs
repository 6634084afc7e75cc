//! `raw`: the broker's limit in this run, persistent publishes with confirms, pipelined.

use super::*;

pub(crate) fn build_messages(
    rabbit: &RabbitConfig,
    records: &[TimeoutRecord],
) -> Vec<OutgoingMessage> {
    let now = SystemTime::now();
    records
        .iter()
        .filter_map(|r| message::build(r, rabbit, now, message::DEFAULT_FRAME_MAX).ok())
        .collect()
}

pub(crate) async fn confirm_channel(uri: &str) -> Result<(Connection, Channel)> {
    let conn = Connection::connect(uri, ConnectionProperties::default())
        .await
        .context("RabbitMQ connection")?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((conn, channel))
}

pub(crate) const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

pub(crate) fn check_confirmation(c: Confirmation) -> Result<()> {
    match c {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => bail!("publish returned (unroutable)"),
        Confirmation::Nack(_) => bail!("publish nacked"),
        Confirmation::NotRequested => bail!("channel not in confirm mode"),
    }
}

/// One raw run: seconds until done, seconds until all confirmed, duplicates, body size.
pub(crate) struct RawRun {
    pub(crate) seconds: f64,
    pub(crate) confirmed_s: f64,
    pub(crate) duplicates: u64,
    pub(crate) body_bytes: Option<usize>,
}

/// The broker's limit: pipelined persistent publishes with confirms, `window` in flight; the
/// best of `TIMEOUTD_BENCH_RAW_REPS` runs (default 3), since a limit is what the broker can do
/// and the machine is shared.
pub(crate) async fn scenario_raw(ctx: &Ctx, scen: &Scen) -> Result<Row> {
    let n = ctx.scaled(DRAIN_RECORDS, 1_000);
    let window: usize = env_parse("TIMEOUTD_BENCH_RAW_WINDOW", 1000);
    let reps: usize = env_parse("TIMEOUTD_BENCH_RAW_REPS", 3).max(1);
    let mut runs = Vec::with_capacity(reps);
    for _ in 0..reps {
        runs.push(raw_once(ctx, scen, n, window).await?);
    }
    let all: Vec<f64> = runs.iter().map(|r| n as f64 / r.seconds).collect();
    let best = runs
        .iter()
        .min_by(|a, b| a.seconds.total_cmp(&b.seconds))
        .context("no raw run")?;
    Ok(Row {
        scenario: "raw".into(),
        description: format!(
            "RabbitMQ persistent publishes with confirms, pipelined ({window} in flight), one channel, {}, best of {reps}",
            if ctx.live {
                "until received by the consumer"
            } else {
                "until all confirmed (no consumer yet)"
            }
        ),
        records: n,
        seconds: Some(best.seconds),
        records_per_s: Some(n as f64 / best.seconds),
        duplicates: Some(runs.iter().map(|r| r.duplicates).sum()),
        details: json!({
            "window": window,
            "runs_records_per_s": all,
            "all_confirmed_seconds": best.confirmed_s,
            "confirmed_per_s": n as f64 / best.confirmed_s,
            "message_body_bytes": best.body_bytes,
        }),
        ..Row::default()
    })
}

pub(crate) async fn raw_once(ctx: &Ctx, scen: &Scen, n: u64, window: usize) -> Result<RawRun> {
    let records: Vec<TimeoutRecord> = (0..n).map(|_| record(&scen.queue, now_ms())).collect();
    let expected: Arc<Expected> = Arc::new(
        records
            .iter()
            .map(|r| (r.id.as_u128(), r.due.timestamp_millis()))
            .collect(),
    );
    let messages = build_messages(&ctx.rabbit, &records);
    let counter = live_counter(ctx, &scen.queue, &expected).await?;
    let (conn, channel) = confirm_channel(&ctx.amqp_uri).await?;
    let started = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    for m in &messages {
        if in_flight.len() >= window
            && let Some(c) = in_flight.next().await
        {
            check_confirmation(c?)?;
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                m.routing_key.as_str().into(),
                MANDATORY,
                &m.body,
                m.properties.clone(),
            )
            .await?;
        in_flight.push(confirm);
    }
    while let Some(c) = in_flight.next().await {
        check_confirmation(c?)?;
    }
    let confirmed_s = started.elapsed().as_secs_f64();
    if let Some(c) = &counter {
        c.wait_for(n, || Ok(())).await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let received = collect(
        ctx,
        &scen.queue,
        n,
        &expected,
        counter,
        Duration::from_millis(300),
    )
    .await?;
    let _ = conn.close(200, "done".into()).await;
    Ok(RawRun {
        seconds,
        confirmed_s,
        duplicates: received.duplicates,
        body_bytes: messages.first().map(|m| m.body.len()),
    })
}
