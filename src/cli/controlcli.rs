//! Pausing and resuming destinations on the command line (`pause`, `resume`, `paused`). Each
//! action is logged with who ran it and
//! recorded in the control collection ([`crate::store::control`]).

use std::time::Duration;

use bson::{DateTime, doc};
use clap::Args;

use crate::cli::opscli::{parse_destination, parse_instant};
use crate::store::Store;
use crate::store::control::Actor;
use crate::store::edit::OpsError;
use crate::store::listing::show_instant;

/// `timeoutd pause`.
#[derive(Debug, Args)]
pub struct PauseArgs {
    /// The queue whose timeouts are held back.
    #[arg(value_parser = parse_destination)]
    pub destination: String,
    /// Resume by itself at this instant (RFC 3339).
    #[arg(long, value_name = "INSTANT", value_parser = parse_instant)]
    pub until: Option<DateTime>,
    /// Why (shown by `paused`, recorded in the control collection).
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `timeoutd resume`.
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The paused queue.
    #[arg(value_parser = parse_destination)]
    pub destination: String,
    /// Raise its send rate from a trickle to unlimited over this time, e.g. 5m.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub ramp: Option<Duration>,
    /// Why (recorded in the control collection).
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `timeoutd pause`.
pub async fn pause(store: &Store, a: PauseArgs) -> anyhow::Result<()> {
    let now = store.clock().now();
    if a.until.is_some_and(|u| u <= now) {
        return Err(OpsError::BadInput(format!(
            "--until {} is not in the future",
            a.until.and_then(show_instant).unwrap_or_default()
        ))
        .into());
    }
    let actor = Actor::current();
    store
        .bounded(
            "pause",
            store.pause(&a.destination, a.until, a.reason.as_deref(), &actor),
        )
        .await?;
    let until = a.until.and_then(show_instant);
    tracing::info!(target: "timeoutd::audit", action = "pause", destination = %a.destination, until = until.as_deref().unwrap_or("resumed"), host = %actor.host, user = %actor.user, reason = a.reason.as_deref().unwrap_or(""), "operator action");
    let details = doc! { "destination": &a.destination, "until": until.clone() };
    store
        .bounded(
            "record the action",
            store.audit("pause", &actor, a.reason.as_deref(), details),
        )
        .await?;
    if a.json {
        let shown = serde_json::json!({ "paused": a.destination, "until": until });
        say!("{shown}");
    } else {
        say!(
            "paused {} until {} (every instance stops claiming it within one poll interval)",
            a.destination,
            until.as_deref().unwrap_or("resumed")
        );
    }
    Ok(())
}

/// `timeoutd resume`.
pub async fn resume(store: &Store, a: ResumeArgs) -> anyhow::Result<()> {
    let actor = Actor::current();
    let was = store
        .bounded("resume", store.resume(&a.destination, a.ramp, &actor))
        .await?;
    let ramp = a.ramp.map(|r| humantime::format_duration(r).to_string());
    if !was && a.ramp.is_none() {
        return Err(OpsError::BadInput(format!("{} is not paused", a.destination)).into());
    }
    tracing::info!(target: "timeoutd::audit", action = "resume", destination = %a.destination, ramp = ramp.as_deref().unwrap_or("none"), was_paused = was, host = %actor.host, user = %actor.user, "operator action");
    let details = doc! { "destination": &a.destination, "ramp": ramp.clone(), "was_paused": was };
    store
        .bounded(
            "record the action",
            store.audit("resume", &actor, a.reason.as_deref(), details),
        )
        .await?;
    if a.json {
        let shown =
            serde_json::json!({ "resumed": a.destination, "ramp": ramp, "was_paused": was });
        say!("{shown}");
        return Ok(());
    }
    match ramp {
        Some(r) => say!(
            "resumed {}, its rate rising to unlimited over {r}",
            a.destination
        ),
        None => say!("resumed {}", a.destination),
    }
    Ok(())
}

/// `timeoutd paused`.
pub async fn paused(store: &Store, json: bool) -> anyhow::Result<()> {
    let pauses = store.bounded("read pauses", store.pauses()).await?;
    if json {
        say!("{}", serde_json::to_string(&pauses)?);
        return Ok(());
    }
    for p in &pauses {
        say!(
            "{}  since={}  until={}  by={}  reason={}",
            p.destination,
            crate::cli::opscli::dash(&p.since),
            p.until.as_deref().unwrap_or("resumed"),
            p.by,
            if p.reason.is_empty() { "-" } else { &p.reason }
        );
    }
    say!("{} paused", pauses.len());
    Ok(())
}
