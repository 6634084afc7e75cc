//! The database's own floors, measured in the same run as timeoutd: what the lease protocol's
//! reads and writes cost with nothing else running, on the same collection shape.
//!
//! - `floor-write`: per batch of [`CLAIM_BATCH`] known ids, oldest first, the claim's
//!   compare-and-swap `updateMany` and the owner- and lease-guarded `deleteMany`, one after
//!   the other: the two writes every record needs. No find, no publish.
//! - `floor-read`: the bounded due `find` alone (whole documents, oldest first, limit one
//!   batch, each read starting past the last one's end), over the same records.

use super::*;

pub async fn scenario_floors(ctx: &Ctx, scen: &Scen) -> Result<Vec<Row>> {
    let n = ctx.scaled(DRAIN_RECORDS, 1_000);
    // The indexes timeoutd runs with (its due index beside the shape's own): every write
    // maintains the same set as in the drains.
    let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
    store.ensure_indexes().await?;
    let (expected, read_insert_s) = insert_records(scen, n, true, due_in_past(n)).await?;
    let read = read_floor(scen, &expected).await?;
    let (expected, insert_s) = insert_records(scen, n, true, due_in_past(n)).await?;
    let write = write_floor(scen, &expected).await?;
    let left = scen.coll.count_documents(doc! {}).await?;
    if left != 0 {
        bail!("the write floor left {left} records");
    }
    let per_ms = |s: f64| s * 1000.0 / n as f64;
    Ok(vec![
        Row {
            scenario: "floor-write".into(),
            description: format!(
                "database write floor: compare-and-swap updateMany then guarded deleteMany per {CLAIM_BATCH} known ids, nothing else"
            ),
            records: n,
            seconds: Some(write.total_s),
            records_per_s: Some(n as f64 / write.total_s),
            details: json!({
                "insert_seconds": insert_s,
                "batches": write.batches,
                "update_ms_per_record": per_ms(write.update_s),
                "delete_ms_per_record": per_ms(write.delete_s),
            }),
            ..Row::default()
        },
        Row {
            scenario: "floor-read".into(),
            description: format!(
                "database read floor: the bounded due find of {CLAIM_BATCH} whole documents alone, oldest first, bounded above as timeoutd's read window bounds it; each batch deleted untimed before the next read"
            ),
            records: read.records,
            seconds: Some(read.total_s),
            records_per_s: Some(read.records as f64 / read.total_s),
            details: json!({
                "insert_seconds": read_insert_s,
                "finds": read.finds,
                "find_ms_per_record": per_ms(read.total_s),
            }),
            ..Row::default()
        },
    ])
}

struct ReadFloor {
    records: u64,
    finds: u64,
    total_s: f64,
}

/// Reads the due records a batch at a time, oldest first, each read bounded above by the due
/// instant of its batch's last record, as timeoutd's read window bounds a claim's read while
/// a backlog drains (SecantusDB bounds an index scan by one operator, and timeoutd gives it the
/// upper one). Between reads, the batch read is deleted by `_id` (not timed), as a drain
/// removes what it sent, so each read starts at the head of what is left.
async fn read_floor(scen: &Scen, expected: &Expected) -> Result<ReadFloor> {
    let shape = scen.shape;
    let path = shape.due_path();
    let mut dues: Vec<i64> = expected.values().copied().collect();
    dues.sort_unstable();
    let now = now_ms();
    let (mut records, mut finds, mut total_s) = (0, 0, 0.0);
    for batch in dues.chunks(CLAIM_BATCH as usize) {
        let Some(last) = batch.last() else { break };
        let mut clauses = vec![doc! { path: { "$lte": shape.due_value(*last) } }];
        clauses.extend(shape::due_and_free(shape, now));
        let t = Instant::now();
        let docs: Vec<Document> = scen
            .coll
            .find(doc! { "$and": clauses })
            .sort(doc! { path: 1 })
            .limit(i64::from(CLAIM_BATCH))
            .await?
            .try_collect()
            .await?;
        total_s += t.elapsed().as_secs_f64();
        finds += 1;
        records += docs.len() as u64;
        let ids: Vec<Bson> = docs.iter().filter_map(|d| d.get("_id").cloned()).collect();
        scen.coll
            .delete_many(doc! { "_id": { "$in": ids } })
            .await?;
    }
    Ok(ReadFloor {
        records,
        finds,
        total_s,
    })
}

struct WriteFloor {
    batches: u64,
    total_s: f64,
    update_s: f64,
    delete_s: f64,
}

async fn write_floor(scen: &Scen, expected: &Expected) -> Result<WriteFloor> {
    let shape = scen.shape;
    let mut ids: Vec<(i64, u128)> = expected.iter().map(|(id, due)| (*due, *id)).collect();
    ids.sort_unstable();
    let mut out = WriteFloor {
        batches: 0,
        total_s: 0.0,
        update_s: 0.0,
        delete_s: 0.0,
    };
    let started = Instant::now();
    for batch in ids.chunks(CLAIM_BATCH as usize) {
        let batch: Vec<Bson> = batch
            .iter()
            .map(|(_, id)| guid::to_bson(Uuid::from_u128(*id), shape.uuids()))
            .collect();
        let now = now_ms();
        let owner = guid::to_bson(Uuid::new_v4(), shape.uuids());
        let mut claim = vec![doc! { "_id": { "$in": batch.clone() } }];
        claim.extend(shape::due_and_free(shape, now));
        let t = Instant::now();
        let taken = scen
            .coll
            .update_many(
                doc! { "$and": claim },
                doc! { "$set": {
                    "Locked": true,
                    "LockedBy": owner.clone(),
                    "LockExpiresAt": DateTime::from_millis(now + V7_LEASE.as_millis() as i64),
                } },
            )
            .await?
            .modified_count;
        out.update_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let deleted = scen
            .coll
            .delete_many(doc! { "$and": [
                { "_id": { "$in": batch.clone() } },
                { "Locked": true },
                { "LockedBy": owner },
                { "LockExpiresAt": { "$gt": DateTime::from_millis(now) } },
            ] })
            .await?
            .deleted_count;
        out.delete_s += t.elapsed().as_secs_f64();
        if taken != batch.len() as u64 || deleted != taken {
            bail!(
                "write floor: {} ids, {taken} claimed, {deleted} deleted",
                batch.len()
            );
        }
        out.batches += 1;
    }
    out.total_s = started.elapsed().as_secs_f64();
    Ok(out)
}
