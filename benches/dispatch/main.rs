//! `cargo bench --bench dispatch`: the dispatch benchmark of issues 5 and 13.
//!
//! Scenarios, each in its own MongoDB database and its own RabbitMQ queue, removed afterwards,
//! on a collection of the shape `TIMEOUTD_BENCH_SHAPE` names (`shape.rs`):
//!
//! - `raw`: the broker's limit in this run: persistent publishes with confirms, pipelined
//!   (a sliding window of unconfirmed publishes, one channel), of messages shaped exactly like
//!   timeoutd's, to one durable queue;
//! - `floors` (rows `floor-write`, `floor-read`): the database's own limits for the lease
//!   protocol's writes and its bounded read (`floors.rs`); timeoutd's rates are given as
//!   ratios to the write floor;
//! - `baseline`: ServiceConnect v7's algorithm, in this process: the v7 claim (candidates,
//!   compare-and-swap `updateMany`, read back by owner), then per record one publish with its
//!   confirm awaited and one owner-guarded `deleteOne`;
//! - `timeoutd-1`, `timeoutd-3`: one and three `timeoutd run` processes draining the same due
//!   records;
//! - `lateness-timeoutd`, `lateness-baseline`: records due uniformly over 30 s at 500/s,
//!   poll interval 1 s; lateness is the consumer's receive instant minus the due instant;
//! - `claim-small`, `claim-large`: `Store::claim` of 500 due records with 10k and with 1M
//!   future records in the collection (scenario key `claim`); `claim-backlog`, not a target:
//!   the same with 50k due records waiting as well, what a drain's claims face;
//! - `claim-paused` (issue 14): claims of 500 with 100k due records of a paused destination
//!   at the head of the due range, per `Time` shape, against the same without them
//!   (`benches/dispatch/paused.rs`);
//! - `rss`: one `timeoutd run` draining 100k due records; its peak RSS (`VmHWM`);
//! - `history` (rows `history-off`, `history-on`, issue 22): `timeoutd-1`'s drain with
//!   `[history] keep` off and on, alternated, twice each, in this run (`history.rs`).
//!
//! Throughput is counted by a consumer on the destination queue (deliveries per `MessageId`,
//! which is the record id; duplicates are deliveries beyond the first) together with the time
//! until the collection is empty.
//!
//! Environment:
//! - `TIMEOUTD_BENCH_MONGODB_URI`: a MongoDB to use (default: start `secantusd-rs` on a free
//!   port in a temporary directory);
//! - `TIMEOUTD_BENCH_AMQP_URI`: RabbitMQ (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! - `TIMEOUTD_BENCH_SCALE`: multiplies every record count and the lateness window
//!   (1 = the sizes, 0.1 for a quick run);
//! - `TIMEOUTD_BENCH_OUT`: where the JSON goes (default `target/bench/dispatch.json`);
//! - `TIMEOUTD_BENCH_ONLY`: comma-separated scenario keys (`raw,floors,baseline,timeoutd-1,
//!   timeoutd-3,lateness-timeoutd,lateness-baseline,claim,claim-paused,rss,history`), default
//!   all;
//! - `TIMEOUTD_BENCH_SHAPE`: `v7` (default: the lease-era schema with ServiceConnect v7's
//!   three indexes, created before every scenario) or `public` (what the public releases
//!   write: date `Time`, C#-legacy GUIDs, no lease fields, no index but `_id`);
//! - `TIMEOUTD_BENCH_BIN`: the `timeoutd` executable (default: the one cargo built with this
//!   bench);
//! - `TIMEOUTD_BENCH_RAW_WINDOW`: unconfirmed publishes in flight for `raw` (default 1000);
//! - `TIMEOUTD_BENCH_RAW_REPS`: `raw` runs, the best counts (default 3);
//! - `TIMEOUTD_BENCH_CONSUMER`: `live` (default) counts deliveries while records are sent,
//!   and a drain ends when all were received and the collection is empty; `after` leaves the
//!   queue without a consumer until the timed part is over (a drain ends when the collection
//!   is empty, `raw` when all are confirmed; confirms then wait for the disk), then counts.
//!   The lateness scenarios always count live;
//! - `TIMEOUTD_BENCH_CLAIM_REPS`: timed claims per size after one untimed warm-up claim, the
//!   median is reported (default 9);
//! - `TIMEOUTD_BENCH_DUMP_DIR`: write each lateness scenario's per-record due and receive
//!   instants there as CSV;
//! - `TIMEOUTD_<SECTION>__<KEY>` set in the environment reach the daemons too (the bench sets
//!   URIs, database, listen address and log level itself; `dispatch.poll_interval` defaults to
//!   1s and `dispatch.batch_size` to 500 unless set).
//!
//! Run by `cargo test --all-targets` (without `--bench`) it only prints how to run it.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

mod claims;
mod consumer;
mod drain;
mod floors;
mod history;
mod paused;
mod raw;
mod report;
mod scenario;
mod services;
mod shape;
mod v7;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use bson::{Bson, DateTime, Document, doc};
use futures::stream::FuturesUnordered;
use futures::{StreamExt, TryStreamExt};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use mongodb::{Client, Collection};
use serde::Serialize;
use serde_json::{Value, json};
use timeoutd::config::{MongoConfig, RabbitConfig};
use timeoutd::record::TimeoutRecord;
use timeoutd::record::guid;
use timeoutd::record::message::{self, OutgoingMessage};
use timeoutd::store::Store;
use timeoutd::store::clock::ServerClock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use claims::*;
use consumer::*;
use drain::*;
use raw::*;
use report::*;
use scenario::*;
use services::*;
use shape::Shape;
use v7::*;

const DEFAULT_AMQP_URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const DEFAULT_OUT: &str = "target/bench/dispatch.json";

/// The sizes at scale 1.
const DRAIN_RECORDS: f64 = 50_000.0;
const RSS_RECORDS: f64 = 100_000.0;
const LATENESS_WINDOW_S: f64 = 30.0;
const LATENESS_RATE: f64 = 500.0;
const CLAIM_FUTURE_SMALL: f64 = 10_000.0;
const CLAIM_FUTURE_LARGE: f64 = 1_000_000.0;
const CLAIM_BATCH: u32 = 500;
const INSERT_CHUNK: usize = 10_000;

/// ServiceConnect v7's defaults, used by the baseline.
const V7_BATCH: i64 = 500;
const V7_LEASE: Duration = Duration::from_secs(300);
const V7_MARGIN: Duration = Duration::from_secs(2);

/// No delivery for this long while records are outstanding: the scenario failed.
const STALL: Duration = Duration::from_secs(30);

/// The scenario keys, in the order they run.
const ALL_SCENARIOS: &[&str] = &[
    "raw",
    "floors",
    "baseline",
    "timeoutd-1",
    "timeoutd-3",
    "lateness-timeoutd",
    "lateness-baseline",
    "claim",
    "claim-paused",
    "rss",
    "history",
];

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "dispatch benchmark: run it with `cargo bench --bench dispatch` (or scripts/bench.sh); skipped under `cargo test`"
        );
        return;
    }
    // secantusd-rs is started from the main thread, which outlives everything: its
    // parent-death signal fires when the thread that forked it exits.
    let started_mongo = match std::env::var("TIMEOUTD_BENCH_MONGODB_URI") {
        Ok(uri) if !uri.is_empty() => None,
        _ => match start_secantus() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("dispatch bench: {e:#}");
                std::process::exit(1);
            }
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(run(started_mongo.as_ref()));
    drop(runtime);
    if let Some(mut s) = started_mongo {
        let _ = s.child.kill();
        let _ = s.child.wait();
    }
    if let Err(e) = result {
        eprintln!("dispatch bench failed: {e:#}");
        std::process::exit(1);
    }
}

async fn run(started_mongo: Option<&Secantus>) -> Result<()> {
    let scale: f64 = env_parse("TIMEOUTD_BENCH_SCALE", 1.0);
    if !scale.is_finite() || scale <= 0.0 {
        bail!("TIMEOUTD_BENCH_SCALE must be a positive number");
    }
    let out_path = PathBuf::from(
        std::env::var("TIMEOUTD_BENCH_OUT").unwrap_or_else(|_| DEFAULT_OUT.to_string()),
    );
    let only: Option<Vec<String>> = std::env::var("TIMEOUTD_BENCH_ONLY")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.split(',').map(|k| k.trim().to_string()).collect());
    if let Some(only) = &only {
        for k in only {
            if !ALL_SCENARIOS.contains(&k.as_str()) {
                bail!(
                    "TIMEOUTD_BENCH_ONLY: unknown scenario `{k}` (known: {})",
                    ALL_SCENARIOS.join(", ")
                );
            }
        }
    }
    let selected = |k: &str| only.as_ref().is_none_or(|o| o.iter().any(|x| x == k));
    let mongo_uri = match started_mongo {
        Some(s) => s.uri.clone(),
        None => std::env::var("TIMEOUTD_BENCH_MONGODB_URI")?,
    };
    let amqp_uri =
        std::env::var("TIMEOUTD_BENCH_AMQP_URI").unwrap_or_else(|_| DEFAULT_AMQP_URI.to_string());
    let bin = timeoutd_bin()?;
    let live = match std::env::var("TIMEOUTD_BENCH_CONSUMER").as_deref() {
        Err(_) | Ok("") | Ok("live") => true,
        Ok("after") => false,
        Ok(other) => bail!("TIMEOUTD_BENCH_CONSUMER: `{other}` is neither live nor after"),
    };
    let client = Client::with_uri_str(&mongo_uri).await?;
    let build_info = client
        .database("admin")
        .run_command(doc! { "buildInfo": 1 })
        .await
        .ok();
    let admin = Connection::connect(&amqp_uri, ConnectionProperties::default())
        .await
        .with_context(|| {
            format!(
                "RabbitMQ at {} (set TIMEOUTD_BENCH_AMQP_URI)",
                timeoutd::config::redact_uri(&amqp_uri)
            )
        })?;
    let admin_channel = admin.create_channel().await?;
    let ctx = Ctx {
        mongo_uri,
        amqp_uri: amqp_uri.clone(),
        client,
        admin,
        admin_channel,
        scale,
        bin,
        work: tempfile::tempdir()?,
        run_id: Uuid::new_v4().simple().to_string()[..8].to_string(),
        rabbit: RabbitConfig::default(),
        live,
        effective_config: std::sync::Mutex::new(None),
        shape: Shape::from_env()?,
        mongo_pid: started_mongo.map(|s| s.child.id()),
    };
    let run_started = Instant::now();
    let load_before = loadavg();
    eprintln!(
        "dispatch bench: scale {scale}, collection shape {}, timeoutd {}, MongoDB {}, RabbitMQ {}",
        ctx.shape.name(),
        ctx.bin.display(),
        timeoutd::config::redact_uri(&ctx.mongo_uri),
        timeoutd::config::redact_uri(&ctx.amqp_uri)
    );

    let mut rows: Vec<Row> = Vec::new();
    for key in ALL_SCENARIOS {
        if !selected(key) {
            continue;
        }
        eprintln!("dispatch bench: {key} ...");
        let t = Instant::now();
        let load_at_start = loadavg();
        let scen = Scen::new(&ctx, key).await?;
        let result = match *key {
            "raw" => scenario_raw(&ctx, &scen).await.map(|r| vec![r]),
            "floors" => floors::scenario_floors(&ctx, &scen).await,
            "baseline" => scenario_baseline(&ctx, &scen).await.map(|r| vec![r]),
            "timeoutd-1" => {
                scenario_timeoutd_drain(&ctx, &scen, key, ctx.scaled(DRAIN_RECORDS, 1_000), 1)
                    .await
                    .map(|r| vec![r])
            }
            "timeoutd-3" => {
                scenario_timeoutd_drain(&ctx, &scen, key, ctx.scaled(DRAIN_RECORDS, 1_000), 3)
                    .await
                    .map(|r| vec![r])
            }
            "lateness-timeoutd" => scenario_lateness(&ctx, &scen, true).await.map(|r| vec![r]),
            "lateness-baseline" => scenario_lateness(&ctx, &scen, false).await.map(|r| vec![r]),
            "claim" => scenario_claim(&ctx, &scen).await,
            "claim-paused" => paused::scenario(&ctx, &scen).await,
            "rss" => scenario_timeoutd_drain(&ctx, &scen, key, ctx.scaled(RSS_RECORDS, 1_000), 1)
                .await
                .map(|r| vec![r]),
            "history" => history::scenario(&ctx, ctx.scaled(DRAIN_RECORDS, 1_000)).await,
            _ => unreachable!(),
        };
        scen.cleanup(&ctx).await;
        match result {
            Ok(mut r) => {
                for row in r.iter_mut() {
                    row.details["scenario_wall_seconds"] = json!(t.elapsed().as_secs_f64());
                    row.details["loadavg_at_start"] = json!(load_at_start);
                }
                rows.extend(r)
            }
            Err(e) => {
                eprintln!("dispatch bench: {key} failed: {e:#}");
                rows.push(Row {
                    scenario: key.to_string(),
                    error: Some(format!("{e:#}")),
                    ..Row::default()
                });
            }
        }
        eprintln!(
            "dispatch bench: {key} done in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }

    let rate_of = |k: &str| {
        rows.iter()
            .find(|r| r.scenario == k && r.error.is_none())
            .and_then(|r| r.records_per_s)
    };
    let (raw, baseline) = (rate_of("raw"), rate_of("baseline"));
    let floor = rate_of("floor-write");
    for r in rows.iter_mut() {
        if r.scenario.starts_with("lateness") {
            continue;
        }
        if let Some(rate) = r.records_per_s {
            r.ratio_to_raw = raw.map(|x| rate / x);
            r.ratio_to_floor = floor.map(|x| rate / x);
            r.ratio_to_baseline = baseline.map(|x| rate / x);
        }
    }
    let targets = targets(&rows);
    print_table(&rows, scale, ctx.live, ctx.shape);
    print_breakdown(&rows);
    print_targets(&targets);

    let report = json!({
        "benchmark": "timeoutd dispatch (issue 5)",
        "generated_at": humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        "scale": scale,
        "consumer": if ctx.live { "live" } else { "after" },
        "shape": ctx.shape.name(),
        "shape_description": ctx.shape.describe(),
        "reduced_run": scale < 1.0,
        "total_seconds": run_started.elapsed().as_secs_f64(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "services": {
            "mongodb_uri": timeoutd::config::redact_uri(&ctx.mongo_uri),
            "mongodb_started_by_bench": started_mongo.is_some(),
            "secantus_version": started_mongo.map(|s| s.version.clone()),
            "mongodb_build_info_version": build_info.as_ref().and_then(|b| b.get_str("version").ok()),
            "amqp_uri": timeoutd::config::redact_uri(&amqp_uri),
            "rabbitmq_version": rabbitmq_version(&amqp_uri),
        },
        "timeoutd_bin": ctx.bin.display().to_string(),
        "timeoutd_effective_config": ctx.effective_config.lock().expect("lock").clone(),
        "notes": [
            "records/s: records divided by the time from the start (process spawn, or the baseline loop's start) until every record was received by a consumer on the destination queue and the collection was empty (consumer live), or until the collection was empty, raw: all confirmed (consumer after)",
            "lateness: consumer receive instant minus due instant, host clock; RabbitMQ may deliver a persistent message before it confirms it, so this is the lateness a receiver sees, within a few ms of confirm minus due; daemon_metrics has timeoutd's own confirm-minus-due histogram bounds",
            "baseline: ServiceConnect v7's claim and per-record send/confirm/deleteOne, given timeoutd's query shape (explicit $and on the Time.0 index) and an immediate re-poll after a full batch, so it is an optimistic v7",
            "duplicates: deliveries of a record id beyond its first",
        ],
        "rows": rows,
        "targets": targets,
    });
    if let Some(dir) = out_path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out_path, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("JSON written to {}", out_path.display());
    let _ = ctx.admin.close(200, "done".into()).await;
    Ok(())
}
