//! State that must survive a future dropped at an `.await` (issue 19), and candidates that
//! changed while a claim waited: a caller's deadline that fires in the middle of a learn or a
//! take must leave nothing behind that stops or delays later claims, and a record rescheduled
//! between a claim's read and its take is never taken at its old `Time`. Real test MongoDB;
//! failpoints delay the server's answers.
#![cfg(feature = "failpoints")]

mod common;

use std::time::Duration;

use common::*;
use timeoutd::clock::ServerClock;
use timeoutd::shapes::REFRESH_WHILE_EMPTY;
use timeoutd::store::Store;

/// The failpoints are the process's: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn store_for(env: &TestEnv, operation_timeout: Duration) -> Store {
    let mut config = env.config();
    config.mongodb.operation_timeout = operation_timeout;
    Store::connect(&config.mongodb, ServerClock::default())
        .await
        .expect("store")
        .with_settings(&config)
}

/// Claims until `n` records were taken in all, or `within` passed; returns how many.
async fn claim_up_to(store: &Store, n: usize, within: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + within;
    let mut taken = 0;
    while taken < n && tokio::time::Instant::now() < deadline {
        let claim = store
            .claim(100, Duration::from_secs(300))
            .await
            .expect("claim");
        taken += claim.rows.len();
        if taken < n {
            // The pace of a poll, not a condition: the loop ends on what the claims took.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    taken
}

/// Issue 19's wedge: a claim's deadline drops the shape cache's learn between its two queries.
/// It once left the cache marked as refreshing for good: every later claim read no shape and
/// took nothing, and only a restart cleared it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shape_learn_dropped_halfway_does_not_stop_later_claims() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let store = store_for(&env, Duration::from_secs(1)).await;
    // An empty collection: no shape is known, and the next claim learns again once this is
    // older than REFRESH_WHILE_EMPTY.
    assert_eq!(store.shapes().await.expect("shapes"), vec![]);
    tokio::time::sleep(REFRESH_WHILE_EMPTY).await;

    // Each query of the learn is answered after 600 ms, within operation_timeout (1 s); the
    // two together are not, so the claim's own deadline (as the dispatch loop bounds it)
    // fires between them.
    fail::cfg("shapes-reply-delay", "return(600)").unwrap();
    let read = store
        .bounded(
            "read claim candidates",
            store.candidates(100, Duration::ZERO, &[]),
        )
        .await;
    fail::remove("shapes-reply-delay");
    assert!(
        read.is_err(),
        "the claim's deadline fired during the learn: {read:?}"
    );

    // Records written afterwards are claimed.
    env.insert_due(3).await;
    let taken = claim_up_to(&store, 3, Duration::from_secs(15)).await;
    assert_eq!(taken, 3, "the records written after the dropped learn");
    env.cleanup().await;
}
