//! `baseline`: ServiceConnect v7's algorithm, run in this process.

use super::*;

/// ServiceConnect v7's poller, single-threaded, as the interop doc describes it.
#[derive(Clone)]
pub(crate) struct V7Poller {
    pub(crate) coll: Collection<Document>,
    pub(crate) shape: Shape,
    pub(crate) channel: Channel,
    pub(crate) rabbit: RabbitConfig,
    pub(crate) poll_interval: Duration,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct V7Stats {
    pub(crate) claims: u64,
    pub(crate) claimed: u64,
    pub(crate) sent: u64,
    pub(crate) deleted: u64,
    pub(crate) lease_lost: u64,
    pub(crate) skipped_margin: u64,
    pub(crate) claim_seconds: f64,
    pub(crate) send_seconds: f64,
    pub(crate) delete_seconds: f64,
}

impl V7Poller {
    /// v7's indexes on the fields its writes use; and, for the due query, an index on the
    /// ticks element, which v7 lacks: the baseline gets the fast due query, so its figure
    /// isolates one-at-a-time sending.
    pub(crate) async fn ensure_indexes(&self) -> Result<()> {
        for (name, keys) in [
            ("bench_v7_due", doc! { self.shape.due_path(): 1 }),
            ("LockedBy_1_Locked_1", doc! { "LockedBy": 1, "Locked": 1 }),
            ("LockExpiresAt_1", doc! { "LockExpiresAt": 1 }),
        ] {
            shape::create_index(&self.coll, name, keys).await?;
        }
        Ok(())
    }

    /// v7's due filter, written as timeoutd writes it (an explicit `$and` over the ticks
    /// element), on which SecantusDB bounds the index scan; with the implicit form its cost
    /// grows with the collection there, which would flatter timeoutd.
    pub(crate) fn due_filter(&self, now: i64) -> Vec<Document> {
        shape::due_and_free(self.shape, now)
    }

    /// Runs until `stop`; polls again at once after a full batch (in the baseline's favour),
    /// else after the poll interval.
    pub(crate) async fn run(&self, stop: CancellationToken) -> Result<V7Stats> {
        let mut st = V7Stats::default();
        while !stop.is_cancelled() {
            let t = Instant::now();
            let rows = self.claim().await?;
            st.claim_seconds += t.elapsed().as_secs_f64();
            st.claims += 1;
            st.claimed += rows.len() as u64;
            let full = rows.len() as i64 >= V7_BATCH;
            for (owner, expires_ms, doc) in rows {
                if stop.is_cancelled() {
                    break;
                }
                if expires_ms - now_ms() < V7_MARGIN.as_millis() as i64 {
                    st.skipped_margin += 1;
                    continue;
                }
                let r = TimeoutRecord::decode(&doc, self.shape.encoding())
                    .map_err(|e| anyhow!("baseline decode: {e}"))?;
                let m = message::build(
                    &r,
                    &self.rabbit,
                    SystemTime::now(),
                    message::DEFAULT_FRAME_MAX,
                )
                .map_err(|e| anyhow!("baseline message: {e}"))?;
                let t = Instant::now();
                let confirm = self
                    .channel
                    .basic_publish(
                        "".into(),
                        m.routing_key.as_str().into(),
                        MANDATORY,
                        &m.body,
                        m.properties,
                    )
                    .await?;
                check_confirmation(confirm.await?)?;
                st.send_seconds += t.elapsed().as_secs_f64();
                st.sent += 1;
                // Re-check the lease (v7 does it with the local clock).
                let now = now_ms();
                if now >= expires_ms {
                    st.lease_lost += 1;
                    continue;
                }
                let t = Instant::now();
                let deleted = self
                    .coll
                    .delete_one(doc! { "$and": [
                        { "_id": doc.get("_id").cloned().unwrap_or(Bson::Null) },
                        { "Locked": true },
                        { "LockedBy": guid::to_bson(owner, self.shape.uuids()) },
                        { "LockExpiresAt": { "$gt": DateTime::from_millis(now) } },
                    ] })
                    .await?
                    .deleted_count;
                st.delete_seconds += t.elapsed().as_secs_f64();
                if deleted == 1 {
                    st.deleted += 1;
                } else {
                    st.lease_lost += 1;
                }
            }
            if !full {
                tokio::select! {
                    _ = tokio::time::sleep(self.poll_interval) => {}
                    _ = stop.cancelled() => {}
                }
            }
        }
        Ok(st)
    }

    /// The v7 claim: candidates oldest first, compare-and-swap `updateMany` under a fresh
    /// owner, read back by owner.
    pub(crate) async fn claim(&self) -> Result<Vec<(Uuid, i64, Document)>> {
        let now = now_ms();
        let owner = Uuid::new_v4();
        let expires = now + V7_LEASE.as_millis() as i64;
        let ids: Vec<Bson> = self
            .coll
            .find(doc! { "$and": self.due_filter(now) })
            .sort(doc! { self.shape.due_path(): 1 })
            .limit(V7_BATCH)
            .projection(doc! { "_id": 1 })
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .into_iter()
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut clauses = vec![doc! { "_id": { "$in": ids } }];
        clauses.extend(self.due_filter(now));
        let filter = doc! { "$and": clauses };
        self.coll
            .update_many(
                filter,
                doc! { "$set": {
                    "Locked": true,
                    "LockedBy": guid::to_bson(owner, self.shape.uuids()),
                    "LockExpiresAt": DateTime::from_millis(expires),
                } },
            )
            .await?;
        let rows: Vec<Document> = self
            .coll
            .find(doc! { "$and": [
                { "LockedBy": guid::to_bson(owner, self.shape.uuids()) },
                { "Locked": true },
                { "LockExpiresAt": { "$gt": DateTime::from_millis(now) } },
            ] })
            .sort(doc! { self.shape.due_path(): 1 })
            .await?
            .try_collect()
            .await?;
        Ok(rows.into_iter().map(|d| (owner, expires, d)).collect())
    }
}

pub(crate) async fn start_v7(
    ctx: &Ctx,
    scen: &Scen,
    poll_interval: Duration,
) -> Result<(V7Poller, Connection)> {
    let (conn, channel) = confirm_channel(&ctx.amqp_uri).await?;
    let poller = V7Poller {
        coll: scen.coll.clone(),
        shape: scen.shape,
        channel,
        rabbit: ctx.rabbit.clone(),
        poll_interval,
    };
    poller.ensure_indexes().await?;
    Ok((poller, conn))
}

pub(crate) async fn scenario_baseline(ctx: &Ctx, scen: &Scen) -> Result<Row> {
    let n = ctx.scaled(DRAIN_RECORDS, 1_000);
    let (poller, conn) = start_v7(ctx, scen, Duration::from_secs(1)).await?;
    let (expected, insert_s) = insert_records(scen, n, true, due_in_past(n)).await?;
    let expected = Arc::new(expected);
    let counter = live_counter(ctx, &scen.queue, &expected).await?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = {
        let s = stop.clone();
        tokio::spawn(async move { poller.run(s).await })
    };
    let emptied = wait_drained(&scen.coll, n, counter.as_ref(), || {
        if task.is_finished() {
            bail!("the baseline poller stopped early");
        }
        Ok(())
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    let stats = task.await.map_err(|e| anyhow!("baseline task: {e}"))??;
    emptied?;
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
    Ok(Row {
        scenario: "baseline".into(),
        description: "ServiceConnect v7 algorithm: v7 claim of 500, then per record one publish awaiting its confirm and one owner-guarded deleteOne".into(),
        records: n,
        seconds: Some(seconds),
        records_per_s: Some(n as f64 / seconds),
        duplicates: Some(received.duplicates),
        details: json!({ "insert_seconds": insert_s, "v7": stats }),
        ..Row::default()
    })
}
