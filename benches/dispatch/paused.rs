//! Scenario `claim-paused` (issue 14): the claim's cost while a paused destination's records
//! sit at the head of the due range. For each `Time` shape (a BSON date; `[ticks, 0]`), in a
//! collection of its own: claims of 500 due records of another destination with no paused
//! record present, then the same with 100k due records of a paused destination before them.
//! Each claim takes the next batch (nothing is released, so the claims keep where the others
//! begin, as an instance does while a pause lasts); the first claim, which reads from the
//! start, is reported apart.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bson::Document;
use mongodb::Collection;
use serde_json::json;
use timeoutd::config::TimeEncoding;
use timeoutd::store::Store;
use timeoutd::store::claim::ClaimPath;
use timeoutd::store::clock::ServerClock;
use timeoutd::store::shapes::Shapes;

use super::{
    CLAIM_BATCH, ClaimMs, Ctx, INSERT_CHUNK, Row, Scen, env_parse, now_ms, percentile, record,
};

/// Due records of the paused destination at the head of the due range.
const PAUSED_RECORDS: f64 = 100_000.0;

async fn insert(
    coll: &Collection<Document>,
    destination: &str,
    n: u64,
    first_ms: i64,
    encoding: TimeEncoding,
) -> Result<f64> {
    let started = Instant::now();
    let mut i = 0;
    while i < n {
        let end = (i + INSERT_CHUNK as u64).min(n);
        let docs: Vec<Document> = (i..end)
            .map(|j| record(destination, first_ms + j as i64).to_document(encoding))
            .collect();
        coll.insert_many(docs).await?;
        i = end;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// `reps + 1` claims leaving `paused` out; (the first, the rest).
async fn time_claims(store: &Store, reps: usize, paused: &[String]) -> Result<(f64, Vec<f64>)> {
    // One claim path for the run, as the dispatch loop keeps one: it keeps where the others begin.
    let claims = ClaimPath::new(store.clone(), Shapes::read_now(store).await?);
    let mut first = f64::NAN;
    let mut rest = Vec::with_capacity(reps);
    for i in 0..=reps {
        let t = Instant::now();
        let candidates = claims
            .candidates(CLAIM_BATCH, Duration::ZERO, paused)
            .await?;
        let claim = claims.take(candidates, Duration::from_secs(300)).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        // The read window may bound a claim short of the batch (a thin read moves its bound
        // on; the daemon then claims again at once): said, not fatal, the median holds.
        if claim.rows.len() < CLAIM_BATCH as usize / 2 {
            eprintln!(
                "dispatch bench: claim-paused: a claim returned {} rows of {CLAIM_BATCH} (read window)",
                claim.rows.len()
            );
        }
        if claim
            .rows
            .iter()
            .any(|r| r.record.as_ref().is_ok_and(|r| r.destination == "paused"))
        {
            bail!("a claim took a record of the paused destination");
        }
        if i == 0 {
            first = ms;
        } else {
            rest.push(ms);
        }
    }
    Ok((first, rest))
}

fn row(
    key: String,
    description: String,
    first: f64,
    samples: Vec<f64>,
    paused: u64,
    insert_s: f64,
) -> Row {
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    Row {
        scenario: key,
        description,
        records: u64::from(CLAIM_BATCH),
        claim_latency_ms: Some(ClaimMs {
            median: percentile(&sorted, 0.5),
            min: sorted.first().copied().unwrap_or(f64::NAN),
            max: sorted.last().copied().unwrap_or(f64::NAN),
            samples,
            future_records: 0,
        }),
        details: json!({
            "paused_records": paused,
            "first_claim_ms": first,
            "paused_insert_seconds": insert_s,
        }),
        ..Row::default()
    }
}

pub async fn scenario(ctx: &Ctx, scen: &Scen) -> Result<Vec<Row>> {
    let reps: usize = env_parse("TIMEOUTD_BENCH_CLAIM_REPS", 9);
    let paused_n = ctx.scaled(PAUSED_RECORDS, 1_000);
    let live_n = u64::from(CLAIM_BATCH) * (reps as u64 + 1);
    let paused = vec!["paused".to_string()];
    let mut rows = Vec::new();
    for (shape, encoding) in [
        ("date", TimeEncoding::Date),
        ("ticks", TimeEncoding::DotnetTicks),
    ] {
        let coll_name = format!("Timeouts_{shape}");
        let coll = ctx
            .client
            .database(&scen.db)
            .collection::<Document>(&coll_name);
        let mut config = ctx.mongo_config(&scen.db);
        config.collection = coll_name;
        config.time_encoding = encoding;
        let store = Store::connect(&config, ServerClock::default()).await?;
        store.ensure_indexes().await?;
        store.refresh_clock().await?;
        let base = now_ms() - 7_200_000;
        // Without paused records: the live records alone.
        insert(&coll, "live", live_n, base + 3_600_000, encoding).await?;
        let (first0, none) = time_claims(&store, reps, &paused).await?;
        coll.delete_many(bson::doc! {}).await?;
        // The paused destination's records first, then the live ones.
        let insert_s = insert(&coll, "paused", paused_n, base, encoding).await?;
        insert(&coll, "live", live_n, base + 3_600_000, encoding).await?;
        let (first, with) = time_claims(&store, reps, &paused).await?;
        rows.push(row(
            format!("claim-paused-{shape}-0"),
            format!("claim of {CLAIM_BATCH} ({shape} Time) leaving a paused destination out, none of its records present, median of {reps}"),
            first0,
            none,
            0,
            0.0,
        ));
        rows.push(row(
            format!("claim-paused-{shape}"),
            format!("claim of {CLAIM_BATCH} ({shape} Time) with {paused_n} due records of a paused destination before them, median of {reps} (the first claim, from the start, in details)"),
            first,
            with,
            paused_n,
            insert_s,
        ));
    }
    Ok(rows)
}
