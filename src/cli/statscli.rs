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
        println!("{shown}");
        return Ok(());
    }
    println!("pending         {}", stats.pending);
    println!("due             {}", stats.due);
    println!("leased          {}", stats.leased);
    println!("expired_leases  {}", stats.expired_leases);
    println!("stuck_locks     {}", stats.stuck_locks);
    println!("unschedulable   {}", stats.unschedulable);
    println!("odd_locked      {}", stats.odd_locked);
    match stats.oldest_due_age_seconds {
        Some(age) => println!("oldest_due_age  {age:.3}s"),
        None => println!("oldest_due_age  -"),
    }
    println!("retrying        {}", stats.retrying);
    println!("parked          {}", stats.parked);
    println!("paused          {}", paused.len());
    for (p, due, all) in &paused {
        println!(
            "  {}  due={due}  records={}  until={}",
            p.destination,
            all.map_or("-".to_string(), |n| n.to_string()),
            p.until.as_deref().unwrap_or("resumed")
        );
    }
    Ok(())
}
