//! `timeoutd parked list|requeue|drop` on the command line. `requeue` and `drop` move or
//! delete records: like `cancel`, they take `--dry-run` and `--reason`, and each run that
//! changes something is logged with who ran it and recorded in the control collection's audit
//! ([`crate::store::control`]). An id no parked record has is bad input (exit 2).

use bson::{Bson, doc};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::record::display_id;
use crate::store::Store;
use crate::store::control::Actor;
use crate::store::edit::OpsError;
use crate::store::parking::Requeued;

#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked records, oldest first.
    List(crate::cli::JsonOnly),
    /// Put parked records back into the timeouts collection, free, with their original Time
    /// (a past Time fires at the next poll), and reset their attempt counts.
    Requeue {
        /// The record's id as `parked list` shows it.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<String>,
        /// Requeue every parked record.
        #[arg(long)]
        all: bool,
        /// Put back a record an earlier requeue was cut short on (it may have put it back,
        /// and it may have fired since).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        change: Change,
    },
    /// Delete a parked record for good.
    Drop {
        /// The record's id as `parked list` shows it.
        id: String,
        #[command(flatten)]
        change: Change,
    },
}

/// The options of a command that moves or deletes parked records.
#[derive(Debug, Args)]
pub struct Change {
    /// Show what would change, change nothing (and record nothing).
    #[arg(long)]
    pub dry_run: bool,
    /// Why (recorded in the control collection).
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What happened to one parked record (`--json`: one object per record).
#[derive(Debug, Serialize)]
struct Done {
    id: String,
    outcome: &'static str,
}

impl Done {
    fn text(&self) -> String {
        let id = &self.id;
        match self.outcome {
            "requeued" => format!("requeued {id}"),
            "already_in_timeouts" => {
                format!("{id} is still in the timeouts collection; dropped the parked copy")
            }
            "parked_again" => {
                format!("requeued {id}, but it failed again and was parked again meanwhile")
            }
            "unreadable" => {
                format!("{id} holds no record with its id; left parked as it is")
            }
            "requeued_before" => format!(
                "{id}: an earlier requeue of it was cut short or runs now; it may have put the record back, and the record may have fired since (see `history`). Left parked: `parked requeue --force {id}` puts it back anyway, `parked drop {id}` drops it"
            ),
            "would_requeue" => format!("would requeue {id} (dry run)"),
            "would_drop" => format!("would drop {id} (dry run)"),
            "dropped" => format!("dropped {id}"),
            _ => format!("{id} is no longer parked"),
        }
    }
}

/// `timeoutd parked list|requeue|drop`. Every call is bounded by `[mongodb]
/// operation_timeout`.
pub async fn parked(action: ParkedCommand, store: &Store) -> anyhow::Result<()> {
    let parking = &store.parking();
    let find = |shown: String| async move {
        store
            .bounded("find a parked record", parking.find_id(&shown))
            .await?
            .ok_or_else(|| OpsError::BadInput(format!("no parked record has id {shown}")))
    };
    match action {
        ParkedCommand::List(crate::cli::JsonOnly { json }) => {
            let records = store.bounded("list", parking.list()).await?;
            if json {
                say!("{}", serde_json::to_string(&records)?);
            } else {
                for r in &records {
                    say!(
                        "{}  {}  {}  attempts={}  destination={}  {}",
                        r.id,
                        r.parked_at,
                        r.reason,
                        r.attempts,
                        r.destination.as_deref().unwrap_or("-"),
                        r.error
                    );
                }
                say!("{} parked", records.len());
            }
            Ok(())
        }
        ParkedCommand::Requeue {
            id,
            all,
            force,
            change,
        } => {
            let ids = match id {
                Some(shown) => vec![find(shown).await?],
                None => store.bounded("list", parking.all_ids()).await?,
            };
            let mut done = Vec::with_capacity(ids.len());
            let mut stopped = None;
            for id in &ids {
                let outcome = if change.dry_run {
                    "would_requeue"
                } else {
                    // A failure after some records were put back: those are still reported
                    // and audited, then the command fails.
                    let requeued = match store.bounded("requeue", parking.requeue(id, force)).await
                    {
                        Ok(requeued) => requeued,
                        Err(e) => {
                            stopped = Some(e);
                            break;
                        }
                    };
                    match requeued {
                        Some(Requeued::Requeued) => "requeued",
                        Some(Requeued::AlreadyInTimeouts) => "already_in_timeouts",
                        Some(Requeued::ParkedAgain) => "parked_again",
                        Some(Requeued::Unreadable) => "unreadable",
                        Some(Requeued::RequeuedBefore) => "requeued_before",
                        None => "gone",
                    }
                };
                done.push(Done {
                    id: display_id(id),
                    outcome,
                });
            }
            let mut details = doc! { "all": all, "force": force };
            if let Some(e) = &stopped {
                details.insert("stopped", crate::redact::redact_text(&e.to_string()));
            }
            report(store, "parked requeue", &change, &done, details).await?;
            match stopped {
                // As `cancel` and `reschedule` say it.
                Some(error) => Err(OpsError::Stopped {
                    done: Vec::new(),
                    error,
                }
                .into()),
                None => Ok(()),
            }
        }
        ParkedCommand::Drop { id, change } => {
            let id: Bson = find(id).await?;
            let outcome = if change.dry_run {
                "would_drop"
            } else if store.bounded("drop", parking.drop(&id)).await? {
                "dropped"
            } else {
                "gone"
            };
            let done = [Done {
                id: display_id(&id),
                outcome,
            }];
            report(store, "parked drop", &change, &done, doc! {}).await
        }
    }
}

/// Prints what was done, then (unless `--dry-run`) logs it with who ran it and records it in
/// the audit.
async fn report(
    store: &Store,
    action: &str,
    change: &Change,
    done: &[Done],
    mut details: bson::Document,
) -> anyhow::Result<()> {
    if change.json {
        say!("{}", serde_json::to_string(done)?);
    } else {
        for d in done {
            say!("{}", d.text());
        }
    }
    if change.dry_run || done.is_empty() {
        return Ok(());
    }
    let changed: Vec<&str> = done
        .iter()
        .filter(|d| !["gone", "unreadable", "requeued_before"].contains(&d.outcome))
        .map(|d| d.id.as_str())
        .collect();
    let actor = Actor::current();
    tracing::info!(target: "timeoutd::audit", action, host = %actor.host, user = %actor.user, reason = change.reason.as_deref().unwrap_or(""), records = changed.len(), "operator action");
    details.insert("done", changed);
    store
        .bounded(
            "record the action",
            store.audit(action, &actor, change.reason.as_deref(), details),
        )
        .await?;
    Ok(())
}
