//! The operator commands on the command line: `list`, `cancel`, `reschedule` (and, in
//! [`crate::cli::controlcli`], `pause`, `resume`, `paused`). Each action that changes something is
//! logged with who ran it and recorded in the control collection ([`crate::store::control`]).
//!
//! Exit codes: 0 done; 1 a runtime failure; 2 bad input (an unknown id, a malformed instant,
//! an empty destination); 3 records under a live lease were left as they are (not with
//! `--skip-leased`).

use std::time::Duration;

use bson::{DateTime, doc};
use clap::Args;
use uuid::Uuid;

use crate::store::Store;
use crate::store::control::Actor;
use crate::store::edit::{Move, OpsError, Outcome, Selector};
use crate::store::listing::{ListFilter, Listed, State, show_instant};

/// `--limit` when not given.
pub const DEFAULT_LIMIT: u32 = 100;

/// An instant on the command line: RFC 3339 with `Z` or an offset, or `YYYY-MM-DD HH:MM:SS`
/// read as UTC.
pub fn parse_instant(s: &str) -> Result<DateTime, String> {
    DateTime::parse_rfc3339_str(s.trim())
        .ok()
        .or_else(|| {
            humantime::parse_rfc3339_weak(s.trim())
                .ok()
                .map(DateTime::from_system_time)
        })
        .ok_or_else(|| {
            format!(
                "`{s}` is not an instant: write RFC 3339, e.g. 2026-11-23T17:00:00Z or 2026-11-23T18:00:00+01:00"
            )
        })
}

/// A signed duration in milliseconds: `5m`, `+5m`, `-90s`.
pub fn parse_signed_duration(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let (sign, rest) = match t.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, t.strip_prefix('+').unwrap_or(t)),
    };
    let d = humantime::parse_duration(rest)
        .map_err(|e| format!("`{s}` is not a duration such as 5m, -90s, 2h: {e}"))?;
    let ms = i64::try_from(d.as_millis()).map_err(|_| format!("`{s}` is too long"))?;
    Ok(sign * ms)
}

pub(crate) fn parse_destination(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("a destination (queue name) must not be empty".into())
    } else {
        Ok(s.to_string())
    }
}

/// `timeoutd list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only records sent to this queue.
    #[arg(long, value_parser = parse_destination)]
    pub destination: Option<String>,
    /// Only the records of this saga (its ProcessManagerId).
    #[arg(long, value_name = "UUID")]
    pub correlation_id: Option<Uuid>,
    /// Only records due before this instant (RFC 3339).
    #[arg(long, value_name = "INSTANT", value_parser = parse_instant)]
    pub due_before: Option<DateTime>,
    /// Only records due after this instant (RFC 3339).
    #[arg(long, value_name = "INSTANT", value_parser = parse_instant)]
    pub due_after: Option<DateTime>,
    /// Only records in this state (`leased` includes `retrying`).
    #[arg(long, value_enum)]
    pub state: Option<State>,
    /// Most records to show, soonest first (at most 10000).
    #[arg(long, default_value_t = DEFAULT_LIMIT, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Which records: ids, or a saga (and optionally one destination).
#[derive(Debug, Args)]
pub struct Which {
    /// Record ids, as `list` shows them.
    #[arg(
        value_name = "ID",
        required_unless_present = "correlation_id",
        conflicts_with = "correlation_id"
    )]
    pub ids: Vec<Uuid>,
    /// Every record of this saga instead.
    #[arg(long, value_name = "UUID")]
    pub correlation_id: Option<Uuid>,
    /// With --correlation-id: only its records sent to this queue.
    #[arg(long, requires = "correlation_id", value_parser = parse_destination)]
    pub destination: Option<String>,
    /// Show what would change, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Records under a live lease are left as they are; exit 0 all the same.
    #[arg(long)]
    pub skip_leased: bool,
    /// Why (recorded in the control collection).
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl Which {
    fn selector(&self) -> Selector {
        match self.correlation_id {
            Some(correlation_id) => Selector::Saga {
                correlation_id,
                destination: self.destination.clone(),
            },
            None => Selector::Ids(self.ids.clone()),
        }
    }
}

/// `timeoutd reschedule`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("to").required(true).args(["at", "in_", "by"])))]
pub struct RescheduleArgs {
    #[command(flatten)]
    pub which: Which,
    /// To this instant (RFC 3339).
    #[arg(long, value_name = "INSTANT", value_parser = parse_instant)]
    pub at: Option<DateTime>,
    /// To now (server clock) plus this, e.g. 10m.
    #[arg(long = "in", id = "in_", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub in_: Option<Duration>,
    /// By this much from its own due instant, e.g. 10m or -5m.
    #[arg(long, value_name = "DURATION", value_parser = parse_signed_duration, allow_hyphen_values = true)]
    pub by: Option<i64>,
}

pub(crate) fn dash(s: &Option<String>) -> &str {
    s.as_deref().unwrap_or("-")
}

fn print_row(r: &Listed, extra: &str) {
    let lease = match (&r.owner, &r.lease_end) {
        (Some(o), Some(end)) => format!("  owner={o} lease_end={end}"),
        (Some(o), None) => format!("  owner={o}"),
        _ => String::new(),
    };
    say!(
        "{}  {}  {:<9} destination={}  correlation_id={}{lease}{extra}",
        r.id,
        dash(&r.due),
        r.state.as_str(),
        dash(&r.destination),
        dash(&r.correlation_id),
    );
}

/// `timeoutd list`.
pub async fn list(store: &Store, a: ListArgs) -> anyhow::Result<()> {
    let filter = ListFilter {
        destination: a.destination,
        correlation_id: a.correlation_id,
        due_before: a.due_before,
        due_after: a.due_after,
        state: a.state,
        limit: a.limit,
    };
    let rows = store.bounded("list", store.list(&filter)).await?;
    if a.json {
        say!("{}", serde_json::to_string(&rows)?);
    } else {
        for r in &rows {
            print_row(r, "");
        }
        let more = if rows.len() as u32 >= a.limit {
            " (limit reached: --limit or a filter shows more)"
        } else {
            ""
        };
        say!("{} listed{more}", rows.len());
    }
    Ok(())
}

/// Prints the outcomes, logs and records the action, and fails with `stopped` (the error
/// the command stopped at), else turns records left under a lease into
/// [`OpsError::LeftLeased`] unless `--skip-leased`.
async fn report(
    store: &Store,
    action: &str,
    which: &Which,
    outcomes: Vec<Outcome>,
    details: bson::Document,
    stopped: Option<OpsError>,
) -> anyhow::Result<()> {
    if which.json {
        say!("{}", serde_json::to_string(&outcomes)?);
    } else {
        for o in &outcomes {
            let new = o
                .new_due
                .as_deref()
                .map(|d| format!("  new_due={d}"))
                .unwrap_or_default();
            crate::cli::out(format_args!("{:<16} ", o.outcome));
            print_row(&o.record, &new);
        }
    }
    let left = outcomes
        .iter()
        .filter(|o| o.outcome == "left_leased")
        .count();
    if !which.dry_run {
        let actor = Actor::current();
        let ids: Vec<String> = outcomes
            .iter()
            .filter(|o| matches!(o.outcome, "cancelled" | "rescheduled"))
            .map(|o| o.record.id.clone())
            .collect();
        let done = ids.len();
        let mut details = details;
        details.insert("done", ids);
        details.insert("left_leased", left as i64);
        if let Some(e) = &stopped {
            details.insert("stopped", crate::redact::redact_text(&e.to_string()));
        }
        tracing::info!(target: "timeoutd::audit", action, host = %actor.host, user = %actor.user, reason = which.reason.as_deref().unwrap_or(""), records = done, left_leased = left, "operator action");
        store
            .bounded(
                "record the action",
                store.audit(action, &actor, which.reason.as_deref(), details),
            )
            .await?;
    }
    if let Some(e) = stopped {
        return Err(e.into());
    }
    if left > 0 && !which.skip_leased {
        return Err(OpsError::LeftLeased(left).into());
    }
    Ok(())
}

fn selection_details(which: &Which) -> bson::Document {
    let mut d = doc! {};
    if !which.ids.is_empty() {
        let ids: Vec<String> = which.ids.iter().map(Uuid::to_string).collect();
        d.insert("ids", ids);
    }
    if let Some(c) = which.correlation_id {
        d.insert("correlation_id", c.to_string());
    }
    if let Some(dest) = &which.destination {
        d.insert("destination", dest);
    }
    d
}

/// The outcomes of a command that changes records, and the error it stopped at, if a call
/// failed after some records were changed (those are still reported and audited).
fn split(
    result: Result<Vec<Outcome>, OpsError>,
) -> Result<(Vec<Outcome>, Option<OpsError>), OpsError> {
    match result {
        Ok(outcomes) => Ok((outcomes, None)),
        Err(OpsError::Stopped { done, error }) => {
            let stopped = OpsError::Stopped {
                done: Vec::new(),
                error,
            };
            Ok((done, Some(stopped)))
        }
        Err(e) => Err(e),
    }
}

/// `timeoutd cancel`.
pub async fn cancel(store: &Store, which: Which) -> anyhow::Result<()> {
    let (outcomes, stopped) = split(store.cancel(&which.selector(), which.dry_run).await)?;
    if !which.dry_run {
        store
            .record_cancelled(&outcomes, which.reason.as_deref())
            .await;
    }
    let details = selection_details(&which);
    report(store, "cancel", &which, outcomes, details, stopped).await
}

/// `timeoutd reschedule`.
pub async fn reschedule(store: &Store, a: RescheduleArgs) -> anyhow::Result<()> {
    let (to, shown) = match (a.at, a.in_, a.by) {
        (Some(t), _, _) => (
            Move::At(t),
            format!("at {}", show_instant(t).unwrap_or_default()),
        ),
        (_, Some(d), _) => (Move::In(d), format!("in {}", humantime::format_duration(d))),
        (_, _, Some(ms)) => (Move::By(ms), format!("by {ms} ms")),
        _ => return Err(OpsError::BadInput("say --at, --in or --by".into()).into()),
    };
    let selector = a.which.selector();
    let moved = store.reschedule(&selector, to, a.which.dry_run).await;
    let (outcomes, stopped) = split(moved)?;
    let mut details = selection_details(&a.which);
    details.insert("to", shown);
    report(store, "reschedule", &a.which, outcomes, details, stopped).await
}

/// The exit code of a failed command: 2 for bad input, 3 for records left under a lease,
/// else 1.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<OpsError>() {
        Some(OpsError::BadInput(_)) => 2,
        Some(OpsError::LeftLeased(_)) => 3,
        _ => 1,
    }
}
