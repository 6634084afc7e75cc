//! Times claims that leave a paused destination out while its records are at the head of
//! the due range: `N` due records of the paused destination, 5,000 of another after them.
//! See README, "Operator control".
//!
//! `cargo run --example paused_claim_cost -- MONGODB_URI [N]` (default N = 100000; uses a new
//! database, dropped at the end).

use std::time::{Duration, Instant};

use bson::{DateTime, Document, doc};
use timeoutd::clock::ServerClock;
use timeoutd::config::{Config, TimeEncoding};
use timeoutd::record::TimeoutRecord;
use timeoutd::store::Store;
use uuid::Uuid;

fn record(destination: &str, due_ms: i64) -> Document {
    TimeoutRecord {
        id: Uuid::new_v4(),
        destination: destination.into(),
        process_manager_id: Uuid::new_v4(),
        due: DateTime::from_millis(due_ms),
        headers: doc! {},
    }
    .to_document(TimeEncoding::DotnetTicks)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let uri = args
        .next()
        .ok_or("usage: paused_claim_cost MONGODB_URI [N]")?;
    let n: i64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(100_000);
    let mut config = Config::default();
    config.mongodb.uri = uri;
    config.mongodb.database = format!("paused_cost_{}", &Uuid::new_v4().simple().to_string()[..8]);
    config.mongodb.time_encoding = TimeEncoding::DotnetTicks;
    let store = Store::connect(&config.mongodb, ServerClock::default())
        .await?
        .with_settings(&config);
    store.refresh_clock().await?;
    store.ensure_indexes().await?;
    let db = mongodb::Client::with_uri_str(&config.mongodb.uri)
        .await?
        .database(&config.mongodb.database);
    let coll = db.collection::<Document>("Timeouts");
    let now = DateTime::now().timestamp_millis();
    let started = Instant::now();
    let mut inserted = 0;
    while inserted < n {
        let chunk = (n - inserted).min(10_000);
        let docs = (0..chunk).map(|i| record("paused", now - 3_600_000 + inserted + i));
        coll.insert_many(docs).await?;
        inserted += chunk;
    }
    coll.insert_many((0..5_000).map(|i| record("live", now - 60_000 + i)))
        .await?;
    println!(
        "inserted {n} paused and 5000 live due records in {:?}",
        started.elapsed()
    );
    let paused = vec!["paused".to_string()];
    for label in [
        "claims of 500 live",
        "claims of 500 live",
        "claims with nothing left",
    ] {
        let mut ms = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let claim = store
                .claim_except(500, Duration::from_secs(60), Duration::ZERO, &paused)
                .await?;
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
            let only_live = claim
                .rows
                .iter()
                .all(|r| r.record.as_ref().is_ok_and(|r| r.destination == "live"));
            if !only_live {
                return Err("a claim took a paused record".into());
            }
        }
        println!("{label}: {ms:.1?} ms");
    }
    db.drop().await?;
    Ok(())
}
