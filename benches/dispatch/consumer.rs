//! The consumer: counts deliveries per record id and stamps each with its receive instant;
//! waiting for a drain to end.

use super::*;

#[derive(Default)]
pub(crate) struct Progress {
    pub(crate) deliveries: AtomicU64,
    pub(crate) unique: AtomicU64,
    /// Microseconds since the Unix epoch of the latest delivery.
    pub(crate) last_us: AtomicU64,
}

pub(crate) struct Received {
    /// First receipt of each expected record: (id, receive instant in Unix µs).
    pub(crate) first: Vec<(u128, i64)>,
    pub(crate) deliveries: u64,
    pub(crate) duplicates: u64,
    pub(crate) unexpected: u64,
    pub(crate) last_us: i64,
}

pub(crate) struct Counter {
    pub(crate) progress: Arc<Progress>,
    pub(crate) stop: CancellationToken,
    pub(crate) task: tokio::task::JoinHandle<Result<Received>>,
    pub(crate) conn: Connection,
}

impl Counter {
    pub(crate) async fn start(ctx: &Ctx, queue: &str, expected: Arc<Expected>) -> Result<Self> {
        let conn = Connection::connect(&ctx.amqp_uri, ConnectionProperties::default())
            .await
            .context("consumer connection")?;
        let channel = conn.create_channel().await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                format!("bench-{}", Uuid::new_v4().simple()).as_str().into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .context("basic.consume")?;
        let progress = Arc::new(Progress::default());
        let stop = CancellationToken::new();
        let (p, s) = (progress.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let _channel = channel;
            let mut seen: HashSet<u128> = HashSet::with_capacity(expected.len());
            let mut out = Received {
                first: Vec::with_capacity(expected.len()),
                deliveries: 0,
                duplicates: 0,
                unexpected: 0,
                last_us: 0,
            };
            loop {
                let next = tokio::select! {
                    d = consumer.next() => d,
                    _ = s.cancelled() => break,
                };
                let delivery = match next {
                    Some(Ok(d)) => d,
                    Some(Err(e)) => return Err(anyhow!("consumer: {e}")),
                    None => break,
                };
                let at = now_us();
                out.deliveries += 1;
                out.last_us = at;
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|m| Uuid::parse_str(m.as_str()).ok())
                    .map(|u| u.as_u128());
                match id {
                    Some(id) if expected.contains_key(&id) => {
                        if seen.insert(id) {
                            out.first.push((id, at));
                            p.unique.fetch_add(1, Ordering::Relaxed);
                        } else {
                            out.duplicates += 1;
                        }
                    }
                    _ => out.unexpected += 1,
                }
                p.deliveries.fetch_add(1, Ordering::Relaxed);
                p.last_us.store(at as u64, Ordering::Relaxed);
            }
            Ok(out)
        });
        Ok(Self {
            progress,
            stop,
            task,
            conn,
        })
    }

    pub(crate) fn unique(&self) -> u64 {
        self.progress.unique.load(Ordering::Relaxed)
    }

    /// Waits until `n` distinct expected records arrived. Fails after [`STALL`] without a
    /// delivery, or when `alive` says a process died.
    pub(crate) async fn wait_for(
        &self,
        n: u64,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let mut last_count = 0;
        let mut last_change = Instant::now();
        while self.unique() < n {
            alive()?;
            let c = self.progress.deliveries.load(Ordering::Relaxed);
            if c != last_count {
                last_count = c;
                last_change = Instant::now();
            } else if last_change.elapsed() > STALL {
                bail!(
                    "stalled: {} of {n} records received, none for {} s",
                    self.unique(),
                    STALL.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Keeps listening `linger` longer (to catch late duplicates), then stops.
    pub(crate) async fn finish(self, linger: Duration) -> Result<Received> {
        tokio::time::sleep(linger).await;
        self.stop.cancel();
        let r = self.task.await.map_err(|e| anyhow!("consumer task: {e}"))?;
        let _ = self.conn.close(200, "done".into()).await;
        r
    }
}

/// Polls until the collection is empty; returns when it was seen empty.
pub(crate) async fn wait_empty(coll: &Collection<Document>, within: Duration) -> Result<Instant> {
    let deadline = Instant::now() + within;
    loop {
        if coll.count_documents(doc! {}).await? == 0 {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("collection not empty after {} s", within.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls until the collection is empty, cheaply (estimated count, then an exact one); fails
/// after [`STALL`] without progress or when `alive` says a worker died.
pub(crate) async fn wait_empty_polling(
    coll: &Collection<Document>,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let mut last = u64::MAX;
    let mut last_change = Instant::now();
    loop {
        alive()?;
        let left = coll.estimated_document_count().await?;
        if left == 0 && coll.count_documents(doc! {}).await? == 0 {
            return Ok(());
        }
        if left != last {
            last = left;
            last_change = Instant::now();
        } else if last_change.elapsed() > STALL {
            bail!(
                "stalled: {left} records left, none removed for {} s",
                STALL.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The consumer, started now when it counts live (`TIMEOUTD_BENCH_CONSUMER=live`).
pub(crate) async fn live_counter(
    ctx: &Ctx,
    queue: &str,
    expected: &Arc<Expected>,
) -> Result<Option<Counter>> {
    if ctx.live {
        Ok(Some(Counter::start(ctx, queue, expected.clone()).await?))
    } else {
        Ok(None)
    }
}

/// The end of a drain: with a live consumer, every record received and the collection
/// empty; otherwise the collection empty.
pub(crate) async fn wait_drained(
    coll: &Collection<Document>,
    n: u64,
    counter: Option<&Counter>,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    match counter {
        Some(c) => {
            c.wait_for(n, &mut alive).await?;
            wait_empty(coll, Duration::from_secs(60)).await?;
            Ok(())
        }
        None => wait_empty_polling(coll, alive).await,
    }
}

/// After the timed part: every delivery counted (the consumer starts now if it was not live),
/// listening `linger` longer for late duplicates.
pub(crate) async fn collect(
    ctx: &Ctx,
    queue: &str,
    n: u64,
    expected: &Arc<Expected>,
    counter: Option<Counter>,
    linger: Duration,
) -> Result<Received> {
    let counter = match counter {
        Some(c) => c,
        None => Counter::start(ctx, queue, expected.clone()).await?,
    };
    counter.wait_for(n, || Ok(())).await?;
    counter.finish(linger).await
}
