//! timeoutd's own indexes on the `Timeouts` collection: created where no index serves the
//! same queries, dropped when one made them redundant; never an index timeoutd did not create.

use bson::{Document, doc};
use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::options::IndexOptions;

use super::{Store, StoreError};
use crate::record::due::Shape;
use crate::record::field;

/// Index names timeoutd creates. They never reuse ServiceConnect's names or key patterns.
/// `timeoutd_due` (`{"Time.0": 1}`, before offsets were served) is no longer used: drop it.
pub const DATE_DUE_INDEX: &str = "timeoutd_due_date";
pub const TICKS_DUE_INDEX: &str = "timeoutd_due_offset";
pub const LEASE_INDEX: &str = "timeoutd_lease";
pub const OWNER_INDEX: &str = "timeoutd_owner";

impl Store {
    /// Creates timeoutd's own indexes where no index serves the same queries: one per `Time`
    /// shape served (so each branch of the due query scans only due records, oldest first),
    /// the lease fields (reaper, census) and the owner. The date index is left out when an
    /// index on `Time` already exists (ServiceConnect v7's `Time_1_Locked_1` serves the same
    /// bounds), the lease index when one leads with `LockExpiresAt` (v7's `LockExpiresAt_1`),
    /// the owner index when one leads with `LockedBy` (v7's `LockedBy_1_Locked_1`): every
    /// index is one more the claim's update and the delete maintain for every record. An own
    /// index made redundant that way (created before v7's appeared) is dropped; no index
    /// timeoutd did not create is ever touched. Also warns when the collection is empty and
    /// the other spelling of the ServiceConnect database holds records.
    pub async fn ensure_indexes(&self) -> Result<(), StoreError> {
        let existing: Vec<(String, Document)> = match self.query(self.coll.list_indexes()).await {
            Ok(cursor) => self
                .query(cursor.try_collect::<Vec<_>>())
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|m| {
                    let name = m.options.and_then(|o| o.name).unwrap_or_default();
                    (name, m.keys)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let served = |first: &str, ours: &str| {
            existing
                .iter()
                .any(|(name, keys)| name != ours && keys.keys().next().is_some_and(|f| f == first))
        };
        let mut indexes = Vec::new();
        if self.encoding.reads_dates() && !served(field::TIME, DATE_DUE_INDEX) {
            indexes.push((DATE_DUE_INDEX, Shape::Date.sort()));
        }
        if self.encoding.reads_ticks() {
            indexes.push((TICKS_DUE_INDEX, Shape::Ticks(0).sort()));
        }
        let mut redundant = Vec::new();
        for (name, first, keys) in [
            (
                LEASE_INDEX,
                field::LOCK_EXPIRES_AT,
                doc! { field::LOCKED: 1, field::LOCK_EXPIRES_AT: 1 },
            ),
            (OWNER_INDEX, field::LOCKED_BY, doc! { field::LOCKED_BY: 1 }),
        ] {
            if !served(first, name) {
                indexes.push((name, keys));
            } else if existing.iter().any(|(n, _)| n == name) {
                redundant.push(name);
            }
        }
        for (name, keys) in indexes {
            let model = IndexModel::builder()
                .keys(keys.clone())
                .options(IndexOptions::builder().name(name.to_string()).build())
                .build();
            if let Err(e) = self.query(self.coll.create_index(model)).await {
                // An index with the same keys under another name serves as well.
                tracing::warn!(index = name, keys = %keys, error = %e, "could not create index; continuing");
            }
        }
        for name in redundant {
            match self.query(self.coll.drop_index(name)).await {
                Ok(()) => {
                    tracing::info!(
                        index = name,
                        "dropped timeoutd's own index: another one serves the same queries, and each index costs every write"
                    )
                }
                // Another instance may have dropped it first.
                Err(e) => {
                    tracing::debug!(index = name, error = %e, "could not drop a redundant index")
                }
            }
        }
        self.warn_if_other_spelling_holds_records().await;
        Ok(())
    }

    /// The default database changed to the public releases' spelling: say so when this
    /// collection is empty and the other spelling's is not.
    async fn warn_if_other_spelling_holds_records(&self) {
        use crate::config::{LEASE_ERA_DATABASE, PUBLIC_DATABASE};
        let other = match self.db.name() {
            PUBLIC_DATABASE => LEASE_ERA_DATABASE,
            LEASE_ERA_DATABASE => PUBLIC_DATABASE,
            _ => return,
        };
        let ours = self.query(self.coll.estimated_document_count()).await;
        let theirs = self
            .query(
                self.db
                    .client()
                    .database(other)
                    .collection::<Document>(self.coll.name())
                    .estimated_document_count(),
            )
            .await;
        if let (Ok(0), Ok(n)) = (ours, theirs)
            && n > 0
        {
            tracing::warn!(
                database = self.db.name(),
                other_database = other,
                records_there = n,
                "this database's timeouts collection is empty but the other spelling of the ServiceConnect database holds records: set [mongodb] database to the one your services write"
            );
        }
    }
}
