//! `claim`: `Store::claim` latency beside 10k and 1M future records, and with a backlog.

use super::*;

/// `Store::claim` of 500 due records beside 10k, then 1M future records.
pub(crate) async fn scenario_claim(ctx: &Ctx, scen: &Scen) -> Result<Vec<Row>> {
    let reps: usize = env_parse("TIMEOUTD_BENCH_CLAIM_REPS", 9);
    let small = ctx.scaled(CLAIM_FUTURE_SMALL, 1_000);
    let large = ctx.scaled(CLAIM_FUTURE_LARGE, small + 1);
    let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
    store.ensure_indexes().await?;
    store.refresh_clock().await?;
    let future_base = now_ms() + 3_600_000;
    let month_ms = 30 * 86_400_000_i64;
    // Due at random instants over the month after next hour.
    let future = |_: u64| future_base + (Uuid::new_v4().as_u128() as i64).rem_euclid(month_ms);
    let (_, due_insert_s) = insert_records(
        scen,
        u64::from(CLAIM_BATCH),
        false,
        due_in_past(u64::from(CLAIM_BATCH)),
    )
    .await?;
    let (_, small_insert_s) = insert_records(scen, small, false, future).await?;
    let small_ms = time_claims(&store, reps).await?;
    let (_, large_insert_s) = insert_records(scen, large - small, false, future).await?;
    let large_ms = time_claims(&store, reps).await?;
    // Not a target of the issue: the same claim when a drain's backlog of due records waits
    // too (what each claim of the timeoutd-1 drain faces at its start).
    let backlog = ctx.scaled(DRAIN_RECORDS, 1_000);
    let (_, backlog_insert_s) = insert_records(
        scen,
        backlog - u64::from(CLAIM_BATCH),
        false,
        due_in_past(backlog),
    )
    .await?;
    let backlog_ms = time_claims(&store, reps).await?;
    let row = |key: &str, future_records: u64, samples: Vec<f64>, insert: Value| {
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        Row {
            scenario: key.into(),
            description: format!(
                "Store::claim of {CLAIM_BATCH} with {future_records} future records in the collection{}, median of {reps}",
                if key == "claim-backlog" {
                    format!(" and {backlog} due")
                } else {
                    format!(" and {CLAIM_BATCH} due")
                }
            ),
            records: u64::from(CLAIM_BATCH),
            claim_latency_ms: Some(ClaimMs {
                median: percentile(&sorted, 0.5),
                min: sorted.first().copied().unwrap_or(f64::NAN),
                max: sorted.last().copied().unwrap_or(f64::NAN),
                samples,
                future_records,
            }),
            details: insert,
            ..Row::default()
        }
    };
    Ok(vec![
        row(
            "claim-small",
            small,
            small_ms,
            json!({ "due_insert_seconds": due_insert_s, "future_insert_seconds": small_insert_s }),
        ),
        row(
            "claim-large",
            large,
            large_ms,
            json!({
                "future_insert_seconds": large_insert_s,
                "future_inserted": large - small,
                "future_insert_per_s": (large - small) as f64 / large_insert_s,
            }),
        ),
        row(
            "claim-backlog",
            large,
            backlog_ms,
            json!({ "due_records": backlog, "due_insert_seconds": backlog_insert_s }),
        ),
    ])
}

/// Times `reps` claims of the due batch, after one untimed warm-up claim (the first after a
/// bulk insert pays for the server's catching up); each claim's rows are released afterwards
/// so that the next claim finds them due again.
pub(crate) async fn time_claims(store: &Store, reps: usize) -> Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(reps);
    for i in 0..=reps {
        let t = Instant::now();
        let claim = store.claim(CLAIM_BATCH, V7_LEASE).await?;
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        if claim.rows.len() != CLAIM_BATCH as usize {
            bail!(
                "claim returned {} rows, expected {CLAIM_BATCH}",
                claim.rows.len()
            );
        }
        let ids: Vec<Bson> = claim.rows.iter().map(|r| r.id.clone()).collect();
        store.release_many(&ids, claim.lease.owner).await?;
    }
    Ok(samples)
}
