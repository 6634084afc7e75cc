//! The monitor's reading of the due backlog: what the backlog alerts and the progress check
//! ([`crate::service::progress`]) read. It depends on nothing the claim path keeps, so a claim path
//! that goes wrong cannot make it read zero:
//! - the `Time` shapes are the learner's ([`crate::store::shapes`]), taken only when a probe
//!   checked them within the monitor's interval, never what the claim path last used;
//! - the pauses and ramps come from the control collection itself, not from what the
//!   dispatch loop applies.
//!
//! Records of paused destinations are counted apart (`timeoutd_paused_backlog`), so that a
//! planned pause pages no one and a wedge always does. Every count stops at
//! [`crate::store::census::BACKLOG_COUNTED_UP_TO`]; the oldest due records are one index seek per
//! `Time` shape (while something is paused, the seek walks past the paused records due before
//! the first other one, as the claim's read from the start does).

use bson::{Bson, DateTime, Document, doc};

use crate::record::due::Shape;
use crate::record::{TimeoutRecord, field};
use crate::store::lease;
use crate::store::{Store, StoreError};

/// One reading of the due backlog.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Reading {
    /// Due records any worker may claim now, of destinations not paused (up to the bound).
    pub due: u64,
    /// Age of the oldest due record (leased or not) of a destination not paused.
    pub oldest_due_age_seconds: Option<f64>,
    /// Due records (leased or not) of paused destinations (up to the bound).
    pub paused_due: u64,
    /// `_id` and due instant of the oldest due record any worker may claim now, of a
    /// destination neither paused nor under a send-rate limit: what every instance's claims
    /// should reach.
    pub oldest_unclaimed: Option<(Bson, DateTime)>,
}

impl Store {
    /// [`Store::read_backlog`] with the shapes read now and no rate limits.
    pub async fn backlog(&self, up_to: u64) -> Result<Reading, StoreError> {
        let shapes = self.shapes().await?;
        self.read_backlog(&shapes, up_to, &[]).await
    }

    /// Reads the backlog over `shapes`, counting up to `up_to`. `rate_limited`: the
    /// destinations with a send-rate limit in this instance's configuration (the resume
    /// ramps in force are read here), left out of [`Reading::oldest_unclaimed`].
    pub async fn read_backlog(
        &self,
        shapes: &[Shape],
        up_to: u64,
        rate_limited: &[String],
    ) -> Result<Reading, StoreError> {
        let control = self.read_control().await?;
        let paused = control.paused;
        let mut left_out = paused.clone();
        left_out.extend(rate_limited.iter().cloned());
        left_out.extend(control.ramps.into_keys());
        left_out.sort();
        left_out.dedup();
        let now = self.clock.now();
        let claimable = lease::due_within(now, None, now, shapes);
        let limit = i64::try_from(up_to).unwrap_or(i64::MAX);
        let count = |filter| self.query(self.coll.count_documents(filter).limit(limit));
        let due = count(lease::except(claimable, &paused)).await?;
        let paused_due = match paused.is_empty() {
            true => 0,
            false => {
                let of_paused = doc! { field::DESTINATION: { "$in": paused.clone() } };
                count(lease::all_of([lease::due_by(now, shapes), of_paused])).await?
            }
        };
        let oldest_due_age_seconds = self.oldest_due_age(now, shapes, &paused).await?;
        let mut oldest_unclaimed: Option<(DateTime, Bson)> = None;
        for shape in shapes {
            let unclaimed = lease::due_within(now, None, now, std::slice::from_ref(shape));
            let found = self
                .oldest(*shape, lease::except(unclaimed, &left_out))
                .await?;
            if let Some((at, id)) = found
                && oldest_unclaimed.as_ref().is_none_or(|(o, _)| at < *o)
            {
                oldest_unclaimed = Some((at, id));
            }
        }
        Ok(Reading {
            due,
            oldest_due_age_seconds,
            paused_due,
            oldest_unclaimed: oldest_unclaimed.map(|(at, id)| (id, at)),
        })
    }

    /// The age in seconds of the oldest due record (leased or not) over `shapes`, of a
    /// destination not in `left_out`: the monitor's reading and `timeoutd stats` alike.
    pub(crate) async fn oldest_due_age(
        &self,
        now: DateTime,
        shapes: &[Shape],
        left_out: &[String],
    ) -> Result<Option<f64>, StoreError> {
        let mut oldest: Option<DateTime> = None;
        for shape in shapes {
            let due = lease::all_of([shape.due_between(None, now)]);
            if let Some((at, _)) = self.oldest(*shape, lease::except(due, left_out)).await? {
                oldest = Some(oldest.map_or(at, |o| o.min(at)));
            }
        }
        Ok(oldest.map(|at| age_seconds(now, at)))
    }

    /// The oldest record of `shape` that `filter` matches: its due instant (the end of the
    /// range when its `Time` does not decode) and `_id`.
    async fn oldest(
        &self,
        shape: Shape,
        filter: Document,
    ) -> Result<Option<(DateTime, Bson)>, StoreError> {
        let first = self
            .query(
                self.coll
                    .find_one(filter)
                    .sort(shape.sort())
                    .projection(doc! { field::ID: 1, field::TIME: 1 }),
            )
            .await?;
        Ok(first.map(|d| {
            let at = TimeoutRecord::decode_due(&d, self.encoding).unwrap_or(self.clock.now());
            (at, d.get(field::ID).cloned().unwrap_or(Bson::Null))
        }))
    }
}

fn age_seconds(now: DateTime, due: DateTime) -> f64 {
    let age_ms = now
        .timestamp_millis()
        .saturating_sub(due.timestamp_millis());
    age_ms.max(0) as f64 / 1000.0
}
