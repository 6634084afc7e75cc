//! timeoutd's control collection (`[mongodb] control_collection`, `<collection>_control` by
//! default; never the timeouts collection): destination pauses, resume ramps, and the audit of
//! every operator action, each with its time, who ran it (host and user) and why.
//!
//! Documents, told apart by `kind`:
//! - `pause`: `_id` `pause:<destination>`, `destination`, `since`, `until` (a date, or null
//!   for a pause without end), `reason`, `by`, `expire_at` (= `until`, for the TTL index);
//! - `ramp`: `_id` `ramp:<destination>`, `destination`, `from`, `until`, `by`, `expire_at`;
//! - `audit`: `action`, `at`, `host`, `user`, `reason`, `details`, `expire_at` (kept
//!   [`AUDIT_RETENTION`]).
//!
//! Every instance reads the pauses and ramps ([`Store::read_control`]) every poll interval, and
//! at once when the collection changes ([`Store::watch_control`]), into the `ControlState` the
//! dispatch loop consults (`crate::operator::control`).

use std::collections::BTreeMap;
use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use serde::Serialize;

use crate::store::backend::ChangeStream;
use crate::store::indexes::{create_index, index_spec};
use crate::store::listing::show_instant;
use crate::store::{Store, StoreError, date, text};

/// How long audit entries are kept.
pub const AUDIT_RETENTION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Who runs a command: this host and this user.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Actor {
    pub host: String,
    pub user: String,
}

impl Actor {
    /// The host name (kernel's, else `HOSTNAME`) and the user (`USER`, `LOGNAME`, else the
    /// uid).
    pub fn current() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "unknown-host".into());
        let user = ["USER", "LOGNAME"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|u| !u.is_empty()))
            .or_else(|| uid().map(|u| format!("uid {u}")))
            .unwrap_or_else(|| "unknown-user".into());
        Self { host, user }
    }

    pub fn label(&self) -> String {
        format!("{}@{}", self.user, self.host)
    }
}

fn uid() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1).map(str::to_string)
}

/// One pause, as `paused` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pause {
    pub destination: String,
    /// RFC 3339.
    pub since: Option<String>,
    /// RFC 3339; `None`: until resumed.
    pub until: Option<String>,
    pub reason: String,
    pub by: String,
}

/// A resume ramp: the destination's send rate rises from a trickle to unlimited between
/// `from` and `until` (server clock, Unix ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ramp {
    pub from: i64,
    pub until: i64,
}

/// What every instance obeys now: paused destinations and resume ramps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub paused: Vec<String>,
    pub ramps: BTreeMap<String, Ramp>,
    /// When the oldest pause in force began (server clock, Unix ms).
    pub oldest_pause_ms: Option<i64>,
}

fn pause_id(destination: &str) -> String {
    format!("pause:{destination}")
}

fn ramp_id(destination: &str) -> String {
    format!("ramp:{destination}")
}

fn string(d: &Document, key: &str) -> String {
    text(d, key).unwrap_or_default()
}

impl Store {
    /// The TTL index that ends pauses, ramps and old audit entries, and the index on `kind`.
    pub async fn ensure_control_indexes(&self) -> Result<(), StoreError> {
        let ttl = index_spec(
            "timeoutd_control_ttl",
            doc! { "expire_at": 1 },
            Some(Duration::ZERO),
        );
        self.query(create_index(&self.control, ttl)).await?;
        let kind = index_spec("timeoutd_control_kind", doc! { "kind": 1 }, None);
        self.query(create_index(&self.control, kind)).await?;
        Ok(())
    }

    /// Records an operator action in the control collection.
    pub async fn audit(
        &self,
        action: &str,
        actor: &Actor,
        reason: Option<&str>,
        details: Document,
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let entry = doc! {
            "kind": "audit",
            "action": action,
            "at": now,
            "host": &actor.host,
            "user": &actor.user,
            "reason": reason.map_or(Bson::Null, |r| Bson::String(r.to_string())),
            "details": details,
            "expire_at": crate::store::lease::add(now, AUDIT_RETENTION),
        };
        self.query(self.control.insert_one(entry)).await?;
        Ok(())
    }

    /// Pauses `destination` fleet-wide, until `until` when set; replaces an earlier pause of
    /// it and ends any resume ramp.
    pub async fn pause(
        &self,
        destination: &str,
        until: Option<DateTime>,
        reason: Option<&str>,
        actor: &Actor,
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let pause = doc! {
            "_id": pause_id(destination),
            "kind": "pause",
            "destination": destination,
            "since": now,
            "until": until.map_or(Bson::Null, Bson::DateTime),
            "reason": reason.unwrap_or(""),
            "by": actor.label(),
            "expire_at": until.map_or(Bson::Null, Bson::DateTime),
        };
        self.query(
            self.control
                .replace_one(doc! { "_id": pause_id(destination) }, pause)
                .upsert(true),
        )
        .await?;
        self.query(
            self.control
                .delete_one(doc! { "_id": ramp_id(destination) }),
        )
        .await?;
        Ok(())
    }

    /// Ends the pause of `destination`; with `ramp`, its send rate rises from a trickle to
    /// unlimited over that time. `false` when it was not paused.
    pub async fn resume(
        &self,
        destination: &str,
        ramp: Option<Duration>,
        actor: &Actor,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now();
        // The ramp before the pause goes: a pause overrides a ramp, so the instances that
        // see the pause gone see the ramp too. Before (found in review), the deletion's
        // change event let them claim the backlog at full rate until the ramp was written,
        // and a ramp that failed to be written left none.
        if let Some(ramp) = ramp.filter(|r| !r.is_zero()) {
            let until = crate::store::lease::add(now, ramp);
            let doc = doc! {
                "_id": ramp_id(destination),
                "kind": "ramp",
                "destination": destination,
                "from": now,
                "until": until,
                "by": actor.label(),
                "expire_at": until,
            };
            self.query(
                self.control
                    .replace_one(doc! { "_id": ramp_id(destination) }, doc)
                    .upsert(true),
            )
            .await?;
        }
        let was = self
            .query(
                self.control
                    .delete_one(doc! { "_id": pause_id(destination) }),
            )
            .await?;
        Ok(was.deleted == 1)
    }

    /// The pauses in force now (a pause past its `until` is over, whether or not the TTL
    /// monitor has removed it yet).
    pub async fn pauses(&self) -> Result<Vec<Pause>, StoreError> {
        let now = self.clock.now();
        let docs = self.control_docs("pause").await?;
        Ok(docs
            .iter()
            .filter(|d| date(d, "until").is_none_or(|u| u > now))
            .map(|d| Pause {
                destination: string(d, "destination"),
                since: date(d, "since").and_then(show_instant),
                until: date(d, "until").and_then(show_instant),
                reason: string(d, "reason"),
                by: string(d, "by"),
            })
            .filter(|p| !p.destination.is_empty())
            .collect())
    }

    /// A change stream of every change to the control collection (for the control watcher).
    pub async fn watch_control(&self) -> Result<ChangeStream, StoreError> {
        Ok(self.control.watch(Vec::new()).await?)
    }

    async fn control_docs(&self, kind: &str) -> Result<Vec<Document>, StoreError> {
        self.query(self.control.find(doc! { "kind": kind }).limit(10_000))
            .await
    }

    /// What every instance obeys now.
    pub async fn read_control(&self) -> Result<Snapshot, StoreError> {
        let now = self.clock.now();
        let pauses = self.pauses().await?;
        let oldest_pause_ms = pauses
            .iter()
            .filter_map(|p| p.since.as_deref())
            .filter_map(|s| DateTime::parse_rfc3339_str(s).ok())
            .map(|t| t.timestamp_millis())
            .min();
        let mut paused: Vec<String> = pauses.into_iter().map(|p| p.destination).collect();
        paused.sort();
        paused.dedup();
        let ramps = self
            .control_docs("ramp")
            .await?
            .iter()
            .filter_map(|d| {
                let (from, until) = (date(d, "from")?, date(d, "until")?);
                (until > now && from < until).then(|| {
                    let ramp = Ramp {
                        from: from.timestamp_millis(),
                        until: until.timestamp_millis(),
                    };
                    (string(d, "destination"), ramp)
                })
            })
            .collect();
        Ok(Snapshot {
            paused,
            ramps,
            oldest_pause_ms,
        })
    }

    /// Per paused destination: its records due now (a walk of the due range), and with
    /// `total` all its records (a scan of the collection: no index has `Destination`, so only
    /// `stats` asks for it, not the daemon's monitor).
    pub async fn paused_backlogs(
        &self,
        total: bool,
    ) -> Result<Vec<(Pause, u64, Option<u64>)>, StoreError> {
        let shapes = self.shapes().await?;
        let now = self.clock.now();
        let mut out = Vec::new();
        for p in self.pauses().await? {
            let mine = doc! { crate::record::field::DESTINATION: &p.destination };
            let due = crate::store::lease::all_of([
                crate::store::lease::due_by(now, &shapes),
                mine.clone(),
            ]);
            let due = self.count(due).await?;
            let all = match total {
                true => Some(self.count(mine).await?),
                false => None,
            };
            out.push((p, due, all));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::MongoConfig;
    use crate::store::backend::{Answering, Op, Reply, Written};
    use crate::store::clock::ServerClock;

    fn actor() -> Actor {
        Actor {
            host: "h".into(),
            user: "u".into(),
        }
    }

    /// `resume --ramp` deleted the pause before it wrote the ramp: the deletion woke every
    /// instance, which claimed the destination's backlog at full rate until the ramp was
    /// read, and a ramp that failed to be written left the destination resumed with none.
    #[tokio::test(start_paused = true)]
    async fn resume_writes_the_ramp_before_it_ends_the_pause() {
        let asked: Arc<Mutex<Vec<Op>>> = Arc::default();
        let ops = asked.clone();
        let backend = Answering::new(move |op: Op| {
            ops.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(op.clone());
            match op {
                // The ramp cannot be written.
                Op::Replace { .. } => Err(crate::store::backend::command_error(
                    91,
                    "ShutdownInProgress",
                    "the server is shutting down",
                )),
                _ => Ok(Reply::Written(Written {
                    deleted: 1,
                    ..Written::default()
                })),
            }
        });
        let store = Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let ramp = Some(Duration::from_secs(600));
        assert!(store.resume("q", ramp, &actor()).await.is_err());
        let ops = asked.lock().unwrap_or_else(|e| e.into_inner());
        assert!(
            !ops.iter().any(|op| matches!(op, Op::Delete { .. })),
            "the pause was ended without its ramp: {ops:?}"
        );
    }
}
