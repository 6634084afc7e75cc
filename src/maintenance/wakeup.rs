//! Wake-ups: a change stream on the timeouts collection tells the dispatch loop when a record
//! is inserted due within the look-ahead, so that it is claimed and fired on time instead of
//! at the next poll. Where the server offers no change streams (a standalone MongoDB), the
//! follower ([`crate::store::follow`]) says so once and polling alone serves.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::record::{TimeoutRecord, field};
use crate::store::Store;
use crate::store::follow::{Change, Followed, follow};
use crate::store::shapes::Shapes;

const INSERTS: Followed = Followed {
    open: "open the change stream",
    what: "inserts",
    unavailable: "no change stream on the timeouts collection: records inserted due sooner than the next poll fire at that poll",
};

/// Watches inserts until shutdown; signals `wake` for each record due within `look_ahead`, and
/// tells the shape learner of each record's `Time` ([`Shapes::inserted`]).
pub async fn run(
    store: Store,
    shapes: Shapes,
    look_ahead: Duration,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let on_insert = |change: Change| {
        let Change::Event(event) = change else {
            return; // inserts meanwhile are claimed by the next poll
        };
        let record = event.get_document("fullDocument").ok();
        shapes.inserted(record.and_then(|d| d.get(field::TIME)), store.encoding());
        let due = record.and_then(|d| TimeoutRecord::decode_due(d, store.encoding()));
        let soon = crate::store::lease::add(store.clock().now(), look_ahead);
        if due.is_some_and(|due| due <= soon) {
            wake.notify_one();
        }
    };
    follow(
        &store,
        INSERTS,
        |s| s.watch_inserts().boxed(),
        on_insert,
        &shutdown,
    )
    .await;
}
