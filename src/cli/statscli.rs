//! `timeoutd stats`: the collection's counts ([`crate::store::census`]) and each paused
//! destination's backlog.

use crate::store::Store;

/// `timeoutd stats`: the counts, and each paused destination with its due and total records.
pub async fn stats(store: &Store, json: bool) -> anyhow::Result<()> {
    let stats = store.bounded("count", store.stats()).await?;
    let paused = store
        .bounded("count paused", store.paused_backlogs(true))
        .await?;
    if json {
        let mut shown = serde_json::to_value(&stats)?;
        let paused: Vec<serde_json::Value> = paused
            .iter()
            .map(|(p, due, all)| {
                serde_json::json!({ "destination": p.destination, "due": due, "records": all, "since": p.since, "until": p.until })
            })
            .collect();
        if let Some(o) = shown.as_object_mut() {
            o.insert("paused_destinations".into(), paused.into());
        }
        say!("{shown}");
        return Ok(());
    }
    say!("pending         {}", stats.pending);
    say!("due             {}", stats.due);
    say!("leased          {}", stats.leased);
    say!("expired_leases  {}", stats.expired_leases);
    say!("stuck_locks     {}", stats.stuck_locks);
    say!("unschedulable   {}", stats.unschedulable);
    say!("odd_locked      {}", stats.odd_locked);
    match stats.oldest_due_age_seconds {
        Some(age) => say!("oldest_due_age  {age:.3}s"),
        None => say!("oldest_due_age  -"),
    }
    say!("retrying        {}", stats.retrying);
    say!("parked          {}", stats.parked);
    say!("paused          {}", paused.len());
    for (p, due, all) in &paused {
        say!(
            "  {}  due={due}  records={}  until={}",
            p.destination,
            all.map_or("-".to_string(), |n| n.to_string()),
            p.until.as_deref().unwrap_or("resumed")
        );
    }
    Ok(())
}
