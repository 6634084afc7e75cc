//! Following a change stream, one policy for every follower (the insert wake-ups,
//! [`crate::maintenance::wakeup`]; the control watcher, [`crate::maintenance::controlwatch`]):
//! open the stream under `[mongodb] operation_timeout` ([`Store::bounded`]), hand each event,
//! and each loss of an open stream, to the caller, and after a failure or the stream's end open
//! it again one [`REOPEN`] later (a failed open waits the longer of that and its [`Pacing`]
//! back-off). A read of the stream the server leaves unanswered for `operation_timeout` past
//! [`AWAIT`] (it answers every read within `AWAIT`, if only with nothing new) is a failure
//! too, so wake-ups never stop in silence behind a server that answers everything else.
//! Where the server has no change streams (a standalone MongoDB) this is said once at info,
//! then at debug while it lasts; polling alone serves. Every wait yields to shutdown, and
//! nothing outlives a drop.

use std::time::Duration;

use bson::Document;
use futures::StreamExt;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::store::backend::{AWAIT, ChangeStream};
use crate::store::pacing::Pacing;
use crate::store::{Store, StoreError};

/// How long to wait before opening a change stream again after it failed or ended.
pub const REOPEN: Duration = Duration::from_secs(30);

/// What a follower hands its caller.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// One change event as the server sent it.
    Event(Document),
    /// The open stream failed or ended: changes may go unseen until it is open again.
    Lost,
}

/// Which change stream a follower follows, as its logs name it.
#[derive(Debug, Clone, Copy)]
pub struct Followed {
    /// The open, as [`Store::bounded`] names it in a deadline error.
    pub open: &'static str,
    /// What is watched: "watching {what} (change stream)" at debug once open.
    pub what: &'static str,
    /// Said once at info when the server has no such change stream: what serves instead.
    pub unavailable: &'static str,
}

/// Follows the change stream `open` opens until `shutdown`, handing each event, and each loss
/// of an open stream, to `on_change`. Returns at shutdown, never before.
pub async fn follow<O, E>(
    store: &Store,
    followed: Followed,
    open: O,
    mut on_change: E,
    shutdown: &CancellationToken,
) where
    O: for<'a> Fn(&'a Store) -> BoxFuture<'a, Result<ChangeStream, StoreError>>,
    E: FnMut(Change),
{
    let mut told = false;
    let mut opening = Pacing::new(store.operation_timeout());
    let bound = store.operation_timeout().saturating_add(AWAIT);
    while !shutdown.is_cancelled() {
        let mut retry = REOPEN;
        let opened = tokio::select! {
            r = store.bounded(followed.open, open(store)) => r,
            _ = shutdown.cancelled() => return,
        };
        match opened {
            Ok(mut stream) => {
                opening.record(&Ok::<(), StoreError>(()));
                tracing::debug!("watching {} (change stream)", followed.what);
                told = false;
                loop {
                    // An open stream answers every read within [`AWAIT`], an event or nothing
                    // new; one that does not answer within the call deadline past that is lost.
                    let read = async { stream.next().await.transpose().map_err(StoreError::from) };
                    let read = tokio::select! {
                        r = crate::deadline::within(bound, "read the change stream", read) => r,
                        _ = shutdown.cancelled() => return,
                    };
                    match read {
                        Ok(Some(Some(event))) => on_change(Change::Event(event)),
                        Ok(Some(None)) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, stream = followed.what, "change stream failed; reopening");
                            on_change(Change::Lost);
                            break;
                        }
                        Ok(None) => {
                            on_change(Change::Lost);
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                retry = retry.max(opening.failed(&e));
                if !told {
                    tracing::info!(error = %e, "{}", followed.unavailable);
                    told = true;
                } else {
                    tracing::debug!(error = %e, stream = followed.what, "change stream still unavailable");
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use bson::doc;
    use futures::FutureExt;

    use super::*;
    use crate::config::MongoConfig;
    use crate::store::clock::ServerClock;

    const FOLLOWED: Followed = Followed {
        open: "open the test stream",
        what: "tests",
        unavailable: "no change stream in this test",
    };

    /// Follows what `open` (given the number of the open) opens, on a store never contacted;
    /// returns the opens so far, the changes handed, the shutdown and the follower's task.
    async fn following(
        open: fn(i32) -> Result<ChangeStream, StoreError>,
    ) -> (
        Arc<AtomicUsize>,
        Arc<Mutex<Vec<Change>>>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let store = Store::connect(&MongoConfig::default(), ServerClock::default())
            .await
            .expect("store");
        let opens: Arc<AtomicUsize> = Arc::default();
        let seen: Arc<Mutex<Vec<Change>>> = Arc::default();
        let shutdown = CancellationToken::new();
        let task = {
            let (opens, seen, shutdown) = (opens.clone(), seen.clone(), shutdown.clone());
            crate::host::spawn(async move {
                let opened = |_: &Store| {
                    let n = opens.fetch_add(1, Ordering::SeqCst) as i32;
                    open(n)
                };
                follow(
                    &store,
                    FOLLOWED,
                    |s| futures::future::ready(opened(s)).boxed(),
                    |c| seen.lock().unwrap_or_else(|e| e.into_inner()).push(c),
                    &shutdown,
                )
                .await;
            })
        };
        (opens, seen, shutdown, task)
    }

    /// Each event reaches the caller; a stream that ends is opened again one [`REOPEN`]
    /// later, not before; shutdown ends the follower while it waits.
    #[tokio::test(start_paused = true)]
    async fn events_reach_the_caller_and_an_ended_stream_reopens_after_the_delay() {
        // Each open: a stream of one event, numbered by the open, that then ends.
        let (opens, seen, shutdown, task) =
            following(|n| Ok(futures::stream::iter(vec![Ok(Some(doc! { "n": n }))]).boxed())).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(opens.load(Ordering::SeqCst), 1);
        tokio::time::sleep(REOPEN).await;
        assert_eq!(opens.load(Ordering::SeqCst), 2);
        let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let event = |n: i32| Change::Event(doc! { "n": n });
        assert_eq!(seen, vec![event(0), Change::Lost, event(1), Change::Lost]);
        shutdown.cancel();
        task.await.expect("the follower returns at shutdown");
    }

    /// A stream that answers every read, if only with nothing new, stays open; one whose
    /// read goes unanswered is lost once the read's bound (the operation timeout past
    /// [`AWAIT`]) passes, and opened again.
    #[tokio::test(start_paused = true)]
    async fn a_stream_that_stops_answering_is_lost_and_reopened() {
        // The first open: ten quiet answers, one a second, then a read never answered.
        let (opens, seen, shutdown, task) = following(|n| {
            let quiet = futures::stream::iter((0..10).map(|_| Ok(None))).then(|r| async {
                tokio::time::sleep(AWAIT).await;
                r
            });
            Ok(match n {
                0 => quiet.chain(futures::stream::pending()).boxed(),
                _ => futures::stream::pending().boxed(),
            })
        })
        .await;
        let bound = MongoConfig::default().operation_timeout + AWAIT;
        tokio::time::sleep(AWAIT * 10 + bound - Duration::from_millis(10)).await;
        assert!(seen.lock().unwrap_or_else(|e| e.into_inner()).is_empty());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            *seen.lock().unwrap_or_else(|e| e.into_inner()),
            [Change::Lost]
        );
        tokio::time::sleep(REOPEN).await;
        assert_eq!(opens.load(Ordering::SeqCst), 2);
        shutdown.cancel();
        task.await.expect("the follower returns at shutdown");
    }

    /// A failed open waits at least [`REOPEN`] before the next.
    #[tokio::test(start_paused = true)]
    async fn a_failed_open_waits_at_least_the_reopen_delay() {
        let (opens, _, shutdown, task) = following(|_| Err(StoreError::NoServerTime)).await;
        tokio::time::sleep(REOPEN - Duration::from_millis(10)).await;
        assert_eq!(opens.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(opens.load(Ordering::SeqCst), 2);
        shutdown.cancel();
        task.await.expect("the follower returns at shutdown");
    }
}
