//! State that must survive a future dropped at an `.await` (issue 19), and candidates that
//! changed while a claim waited: a caller's deadline that fires in the middle of a learn or a
//! take must leave nothing behind that stops or delays later claims, and a record rescheduled
//! between a claim's read and its take is never taken at its old `Time`. Real test MongoDB;
//! failpoints delay the server's answers.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness
#![cfg(feature = "failpoints")]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bson::{DateTime, doc};
use common::csharp::{offset_record, public_record};
use common::*;
use timeoutd::store::Store;
use timeoutd::store::claim::ClaimPath;
use timeoutd::store::clock::ServerClock;
use timeoutd::store::edit::{Move, Selector};
use timeoutd::store::shapes::{Shapes, learner};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

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
async fn claim_up_to(claims: &ClaimPath, n: usize, within: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + within;
    let mut taken = 0;
    while taken < n && tokio::time::Instant::now() < deadline {
        let read = claims.candidates(100, Duration::ZERO, &[]).await;
        let claim = claims
            .take(read.expect("candidates"), Duration::from_secs(300))
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

/// Issue 19's wedge: a claim's deadline fired in the middle of a shape learn, and left the
/// shapes marked as being learned for good: every later claim read no shape and took nothing,
/// and only a restart cleared it. The learn is the learner task's now, never a claim's: a
/// claim whose deadline fires while it waits for the first learn leaves it to finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_dropped_during_the_first_shape_learn_does_not_stop_later_claims() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let store = store_for(&env, Duration::from_secs(1)).await;
    // Each query of the learn is answered after 600 ms, within operation_timeout (1 s); the
    // two together are not, so the claim's own deadline (as the dispatch loop bounds it)
    // fires while it waits for them.
    fail::cfg("shapes-reply-delay", "return(600)").unwrap();
    let (learner, shapes) = learner(&store);
    let stop = CancellationToken::new();
    tokio::spawn(
        learner
            .expect("the collection's shapes are learned")
            .run(stop.clone()),
    );
    let claims = ClaimPath::new(store.clone(), shapes);
    let read = store
        .bounded(
            "read claim candidates",
            claims.candidates(100, Duration::ZERO, &[]),
        )
        .await;
    assert!(
        read.is_err(),
        "the claim's deadline fired during the learn: {read:?}"
    );
    fail::remove("shapes-reply-delay");

    // Records written afterwards are claimed.
    env.insert_due(3).await;
    let taken = claim_up_to(&claims, 3, Duration::from_secs(15)).await;
    assert_eq!(taken, 3, "the records written after the dropped claim");
    stop.cancel();
    env.cleanup().await;
}

/// A take whose deadline fires after the server applied its compare-and-swap: the records it
/// leased are freed at once, not a whole lease later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_dropped_after_its_claim_frees_what_it_leased() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let store = store_for(&env, Duration::from_secs(1)).await;
    let ids = env.insert_due(3).await;

    fail::cfg("claim-taken-delay", "1*return(1500)").unwrap();
    let claim = store
        .bounded("claim", store.claim(100, Duration::from_secs(300)))
        .await;
    fail::remove("claim-taken-delay");
    assert!(
        claim.is_err(),
        "the deadline fired after the compare-and-swap: {claim:?}"
    );

    let all: Vec<bson::Bson> = ids.iter().map(|id| uuid(*id)).collect();
    let free = doc! { "$and": [{ "_id": { "$in": all } }, is_free()] };
    let freed = eventually(Duration::from_secs(10), || async {
        env.count(free.clone()).await == 3
    })
    .await;
    assert!(
        freed,
        "the records leased by the dropped take are free again well before their 300 s lease ran out"
    );
    let claims = ClaimPath::new(store.clone(), Shapes::read_now(&store).await.unwrap());
    assert_eq!(claim_up_to(&claims, 3, Duration::from_secs(10)).await, 3);
    env.cleanup().await;
}

/// Finding 5: candidates read, then rescheduled (by `timeoutd reschedule`, and by a writer
/// that sets `Time` itself) before the take, within the look-ahead. Each is scheduled by its
/// new `Time`, never the one read. Both shapes of `Time`.
///
/// When one candidate was not yet due as read, the take leases them all and reads them back
/// as they are then (issue 26; before, it left them for the next claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_rescheduled_after_its_claim_read_it_is_taken_at_its_new_time() {
    let per_claim = rescheduled_between_read_and_take(true).await;
    assert_eq!(per_claim, [4], "one claim takes them all");
}

/// When every candidate was due as read, the take needs no read-back: it takes only what is
/// due at its own instant, so the records moved into the future are left free for the next
/// claim (the first says there is more), which takes them at their new `Time`. Fails if the
/// take keeps the read's horizon: the moved records are then sent at the `Time` read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_rescheduled_after_a_read_of_due_records_is_left_for_the_next_claim() {
    let per_claim = rescheduled_between_read_and_take(false).await;
    assert_eq!(
        per_claim,
        [1, 2],
        "the moved records wait for a claim of their own"
    );
}

/// Three records due, and one not yet due when `not_yet_due`; the candidates read; two of
/// them moved 30 s on; then claims until all are taken. Checks each was taken at its `Time`
/// as it is now, and returns how many records each claim that took any took.
async fn rescheduled_between_read_and_take(not_yet_due: bool) -> Vec<usize> {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let store = store_for(&env, Duration::from_secs(5)).await;
    let (dated, offset, unchanged, later) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let due = in_ms(-10);
    let later_due = in_ms(60_000);
    let mut records = vec![
        public_record(dated, &env.queue, Uuid::new_v4(), due),
        offset_record(offset, &env.queue, Uuid::new_v4(), due, 60),
        v7_record(unchanged, &env.queue, Uuid::new_v4(), due, doc! {}),
    ];
    if not_yet_due {
        records.push(v7_record(
            later,
            &env.queue,
            Uuid::new_v4(),
            later_due,
            doc! {},
        ));
    }
    env.insert(records).await;
    let look_ahead = Duration::from_secs(120);
    let claims = ClaimPath::new(store.clone(), Shapes::read_now(&store).await.unwrap());
    let candidates = claims
        .candidates(100, look_ahead, &[])
        .await
        .expect("candidates");

    // While the claim waits (for the broker's first answer, in the dispatch loop): one
    // record moved 30 s on by timeoutd, one by a writer of its own.
    let moved = store
        .reschedule(&Selector::Ids(vec![dated]), Move::By(30_000), false)
        .await
        .expect("reschedule");
    assert_eq!(moved[0].outcome, "rescheduled");
    let offset_due = DateTime::from_millis(due.timestamp_millis() + 30_000);
    let offset_doc = env.find(offset).await.expect("offset record");
    let new_time = timeoutd::store::edit::same_shape(offset_doc.get("Time").unwrap(), offset_due)
        .expect("same shape");
    env.coll
        .update_one(
            doc! { "_id": uuid(offset) },
            doc! { "$set": { "Time": new_time } },
        )
        .await
        .expect("move the offset record");

    let mut taken: HashMap<Uuid, i64> = HashMap::new();
    let mut per_claim = Vec::new();
    let mut claim = claims
        .take(candidates, Duration::from_secs(300))
        .await
        .expect("take");
    loop {
        per_claim.push(claim.rows.len());
        for row in &claim.rows {
            let record = row.record.as_ref().expect("decodes");
            assert!(
                taken
                    .insert(record.id, record.due.timestamp_millis())
                    .is_none(),
                "taken twice"
            );
        }
        if !claim.more || per_claim.len() > 3 {
            break;
        }
        let candidates = claims
            .candidates(100, look_ahead, &[])
            .await
            .expect("candidates");
        claim = claims
            .take(candidates, Duration::from_secs(300))
            .await
            .expect("take");
    }
    let new_due = due.timestamp_millis() + 30_000;
    let mut expected = HashMap::from([
        (dated, new_due),
        (offset, new_due),
        (unchanged, due.timestamp_millis()),
    ]);
    if not_yet_due {
        expected.insert(later, later_due.timestamp_millis());
    }
    assert_eq!(
        taken, expected,
        "each taken at its Time as it is now, not as the claim read it"
    );
    env.cleanup().await;
    per_claim.retain(|n| *n > 0);
    per_claim
}
