//! `timeoutd history`: what fired (and what was parked or cancelled), newest first, read from
//! `<collection>_history` ([`crate::store::history::read`]).
//!
//! Exit codes as every command: 0 done (no rows included), 1 a runtime failure, 2 bad input.

use std::time::Duration;

use bson::DateTime;
use clap::Args;
use uuid::Uuid;

use crate::cli::opscli::{dash, parse_destination, parse_instant};
use crate::store::Store;
use crate::store::history::read::{Entry, Filter};

/// `--since`: an instant, or how far back from now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Since {
    At(DateTime),
    Ago(Duration),
}

/// `2026-11-23T17:00:00Z` (RFC 3339), or a duration back from now (server clock): `2h`.
pub fn parse_since(s: &str) -> Result<Since, String> {
    if let Ok(d) = humantime::parse_duration(s.trim()) {
        return Ok(Since::Ago(d));
    }
    parse_instant(s).map(Since::At).map_err(|_| {
        format!("`{s}` is neither an instant (RFC 3339, e.g. 2026-11-23T17:00:00Z) nor a duration back from now (e.g. 2h)")
    })
}

/// A record id as `list` shows it: a GUID in any case or brace style is normalised.
fn parse_timeout_id(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("a timeout id must not be empty".into());
    }
    Ok(Uuid::parse_str(t).map_or_else(|_| t.to_string(), |u| u.to_string()))
}

/// `timeoutd history`.
#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// Only this saga's timeouts (its ProcessManagerId, the message's CorrelationId).
    #[arg(long, value_name = "UUID")]
    pub correlation_id: Option<Uuid>,
    /// Only this record (its id as `list` shows it).
    #[arg(long, value_name = "ID", value_parser = parse_timeout_id)]
    pub timeout_id: Option<String>,
    /// Only those sent to this queue.
    #[arg(long, value_parser = parse_destination)]
    pub destination: Option<String>,
    /// Only since this instant (RFC 3339), or this long ago (e.g. 2h).
    #[arg(long, value_name = "INSTANT|DURATION", value_parser = parse_since)]
    pub since: Option<Since>,
    /// Most rows to show, newest first (at most 10000).
    #[arg(long, default_value_t = crate::cli::opscli::DEFAULT_LIMIT, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn print(e: &Entry) {
    let mut line = format!(
        "{}  {:<9} timeout_id={}  correlation_id={}  destination={}  due={}",
        dash(&e.at),
        e.event,
        e.timeout_id,
        dash(&e.correlation_id),
        dash(&e.destination),
        dash(&e.due),
    );
    let mut add = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            line.push_str(&format!("  {k}={v}"));
        }
    };
    add("late_ms", e.late_ms.map(|n| n.to_string()));
    add("attempts", e.attempts.map(|n| n.to_string()));
    add("message_id", e.message_id.clone());
    add("instance", e.instance.clone());
    add("reason", e.reason.clone());
    add("detail", e.detail.clone());
    say!("{line}");
}

/// `timeoutd history`.
pub async fn history(store: &Store, a: HistoryArgs) -> anyhow::Result<()> {
    if !store.history_on() {
        tracing::warn!(
            "[history] keep is 0s (off) in this configuration: this instance records nothing; showing what is stored"
        );
    }
    let since = a.since.map(|s| match s {
        Since::At(t) => t,
        Since::Ago(d) => DateTime::from_millis(
            store
                .clock()
                .now()
                .timestamp_millis()
                .saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        ),
    });
    let filter = Filter {
        correlation_id: a.correlation_id.map(|u| u.to_string()),
        timeout_id: a.timeout_id,
        destination: a.destination,
        since,
        limit: i64::from(a.limit),
    };
    let rows = store
        .bounded("read history", store.read_history(&filter))
        .await?;
    if a.json {
        say!("{}", serde_json::to_string(&rows)?);
    } else {
        for r in &rows {
            print(r);
        }
        let more = if rows.len() >= a.limit as usize {
            " (limit reached: --limit or a filter shows more)"
        } else {
            ""
        };
        say!("{} shown{more}", rows.len());
    }
    Ok(())
}
