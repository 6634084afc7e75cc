//! Focused tests of the dispatch loop's handlers (issue 25, item 8): a [`Dispatcher`] built
//! without a server, driven by calling its handlers, on virtual time. Where a call must not
//! answer, the store or the broker is a local listener that accepts connections and never
//! replies.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{Bson, doc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::held::Ready;
use super::settle::{self, Settle};
use super::{Dispatcher, Done, LinkWork, MAX_SETTLING, Signals};
use crate::config::Config;
use crate::dispatch::publisher::{Publisher, SendOutcome};
use crate::record::TimeoutRecord;
use crate::service::health::Health;
use crate::store::Store;
use crate::store::clock::ServerClock;
use crate::store::lease::Lease;

async fn dispatcher(config: Config) -> Dispatcher {
    // Never contacted unless a test says so: no claim starts and no settling runs.
    let store = Store::connect(&config.mongodb, ServerClock::default())
        .await
        .expect("store");
    let publisher = Publisher::new(&config.rabbitmq).expect("publisher");
    let health = Arc::new(Health::new(config.dispatch.poll_interval));
    Dispatcher::new(
        Arc::new(config),
        store,
        Arc::default(),
        publisher,
        health,
        CancellationToken::new(),
        Signals::default(),
    )
}

/// A record due at `due` held under `lease`.
fn ready(n: i32, due: bson::DateTime, lease: Lease) -> Ready {
    Ready {
        id: Bson::Int32(n),
        raw: doc! {},
        record: TimeoutRecord {
            id: crate::host::uuid(),
            destination: "timeoutd-test-dispatch-unit".into(),
            process_manager_id: crate::host::uuid(),
            due,
            headers: doc! {},
        },
        lease,
    }
}

fn refused(r: Ready) -> Settle {
    Settle::Refused {
        ready: Box::new(r),
        outcome: SendOutcome::Returned,
    }
}

/// A TCP port that accepts connections (the kernel completes them) and never answers: a
/// server that stalled from before the test began.
fn silent_server() -> (std::net::TcpListener, u16) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    (listener, port)
}

/// Counters recorded on this thread while it is installed (a current-thread runtime runs
/// every task of the test on it).
#[derive(Default)]
struct Counts(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

impl Counts {
    /// The records counted as possible duplicates, whatever the series is named (issue 25,
    /// 8.9 gives each meaning of `timeoutd_lease_lost_total` a series of its own).
    fn possible_duplicates(&self) -> u64 {
        let counters = self.0.lock().expect("counts");
        counters
            .iter()
            .filter(|(name, _)| name.contains("duplicate") || name.contains("lease_lost"))
            .map(|(_, c)| c.load(Ordering::Relaxed))
            .sum()
    }
}

impl metrics::Recorder for Counts {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let counter = self
            .0
            .lock()
            .expect("counts")
            .entry(name)
            .or_default()
            .clone();
        metrics::Counter::from_arc(counter)
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Issue 25, 8.3: with a destination that refuses every send, each wave queued its whole batch
/// of refused records to settle, and the next claim started all the same, so the queue grew
/// without bound and records waited in it past their lease. Claims now wait while two
/// batches wait to settle.
#[tokio::test(start_paused = true)]
async fn claims_wait_while_a_batch_waits_to_settle() {
    let mut config = Config::default();
    config.dispatch.batch_size = 10;
    let mut d = dispatcher(config).await;
    d.link_up = true;
    assert!(d.can_claim(), "nothing held, nothing to settle");
    let now = d.store.clock().now();
    let lease = Lease::new(now, Duration::from_secs(300));
    for n in 0..20 {
        d.settle.push_back(refused(ready(n, now, lease)));
    }
    assert!(
        !d.can_claim(),
        "a claim starts while {} refused records wait to settle",
        d.settle.records()
    );
    // Confirmed records waiting for a removal slot count too.
    let _ = d.settle.pop_front();
    assert!(d.can_claim(), "less than two batches wait");
    d.settle.confirmed.push(ready(20, now, lease));
    assert!(
        !d.can_claim(),
        "a confirmed record waiting for removal counts"
    );
}

/// Issue 25, 8.3: a refused record waited to settle until its lease ran out; its retry
/// bookkeeping then found the lease gone (counted as a lost lease) and the record came back
/// to a claim. Work that has not started by the lease safety margin is released instead,
/// ahead of the rest.
#[tokio::test(start_paused = true)]
async fn settling_not_started_by_the_lease_margin_is_released_instead() {
    let config = Config::default();
    let margin = config.dispatch.lease_safety_margin;
    let mut d = dispatcher(config).await;
    let now = d.store.clock().now();
    let expiring = Lease::new(now, margin / 2);
    let fresh = Lease::new(now, Duration::from_secs(300));
    d.settle.push_back(refused(ready(1, now, fresh)));
    d.settle.push_back(refused(ready(2, now, expiring)));
    // Every slot is busy: the queue is only looked at.
    d.settling = MAX_SETTLING;
    d.start_settling();
    let queued: Vec<String> = d
        .settle
        .work()
        .map(|s| match s {
            Settle::Release { ids, reason, .. } => format!("release {ids:?} ({reason})"),
            Settle::Refused { ready, .. } => format!("retry {:?}", ready.id),
            Settle::Park { id, .. } => format!("park {id:?}"),
        })
        .collect();
    assert_eq!(
        queued,
        ["release [Int32(2)] (margin)", "retry Int32(1)"],
        "the record whose lease reaches the margin is released first"
    );
}

/// Issue 25, 8.5: the claims after an unconfirmed wave were spaced by the link's back-off,
/// which the reconnect that follows such a wave reset: the hold-off never grew. It grows now
/// while waves go unconfirmed, reconnects or not, and starts again after a confirmed wave.
#[tokio::test(start_paused = true)]
async fn the_hold_off_after_unconfirmed_waves_grows_across_reconnects() {
    /// One wave of one record with `outcome`; returns the hold-off on claims after it.
    fn wave(d: &mut Dispatcher, n: i32, outcome: SendOutcome) -> Duration {
        let now = d.store.clock().now();
        d.in_flight
            .push(ready(n, now, Lease::new(now, Duration::from_secs(300))));
        d.on_wave_sent(vec![outcome], vec![None], Duration::ZERO);
        d.claims.next_at().saturating_duration_since(Instant::now())
    }
    let mut d = dispatcher(Config::default()).await;
    d.link_up = true;
    let mut holds = Vec::new();
    for n in 0..6 {
        let hold = wave(&mut d, n, SendOutcome::TimedOut);
        holds.push(hold);
        // The link was suspect and reconnects; the connect succeeds.
        d.on_connected(Ok(()));
        tokio::time::advance(hold).await;
    }
    assert!(
        holds.windows(2).all(|w| w[0] <= w[1]),
        "the hold-off shrank: {holds:?}"
    );
    // From 100 ms doubling: the sixth is at least 3.2 s (it stayed near 100 ms before).
    assert!(
        holds[5] >= Duration::from_millis(3_200),
        "the hold-off did not grow: {holds:?}"
    );
    // A confirmed wave starts it again from the base.
    assert_eq!(wave(&mut d, 6, SendOutcome::Confirmed), Duration::ZERO);
    let after = wave(&mut d, 7, SendOutcome::TimedOut);
    assert!(after < holds[5], "{after:?} after a confirmed wave");
}

/// A store on a server that accepts and never answers, with calls bounded by `timeout`.
async fn silent_store(port: u16, timeout: Duration) -> Store {
    let mut config = Config::default();
    config.mongodb.uri = format!(
        "mongodb://127.0.0.1:{port}/?directConnection=true&serverSelectionTimeoutMS=36000000"
    );
    config.mongodb.operation_timeout = timeout;
    Store::connect(&config.mongodb, ServerClock::default())
        .await
        .expect("store")
}

fn sent(n: i32, now: bson::DateTime) -> (Bson, TimeoutRecord) {
    let r = ready(n, now, Lease::new(now, Duration::from_secs(1)));
    (r.id, r.record)
}

/// Issue 25, 8.6: after SIGTERM, a removal still waiting for MongoDB when the daemon's drain
/// deadline aborted the loop left its confirmed records leased, to be sent again after the
/// lease, and counted nothing. An abandoned removal counts its records as possible duplicates.
#[tokio::test(start_paused = true)]
async fn a_removal_aborted_unfinished_counts_its_records_as_possible_duplicates() {
    let counts = Counts::default();
    let _recorder = metrics::set_default_local_recorder(&counts);
    let (_server, port) = silent_server();
    let store = silent_store(port, Duration::from_secs(60)).await;
    let health = Health::new(Duration::from_secs(1));
    let now = store.clock().now();
    let confirmed: Vec<(Bson, TimeoutRecord)> = (0..3).map(|n| sent(n, now)).collect();
    let lease = Lease::new(now, Duration::from_secs(300));
    let (shutdown, drain_over) = (CancellationToken::new(), CancellationToken::new());
    shutdown.cancel();
    let removal = crate::host::spawn(async move {
        settle::remove(&store, &health, &confirmed, &lease, &shutdown, &drain_over).await;
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!removal.is_finished(), "the delete waits for the server");
    // As the supervisor does at the drain deadline.
    removal.abort();
    assert!(removal.await.is_err_and(|e| e.is_cancelled()));
    assert_eq!(counts.possible_duplicates(), 3);
}

/// Issue 25, 8.6: the loop's removals give up when the shutdown's drain ends (before the daemon
/// aborts the loop), counting what they could not remove as possible duplicates.
#[tokio::test(start_paused = true)]
async fn removals_give_up_when_the_drain_ends_and_count_their_records() {
    let counts = Counts::default();
    let _recorder = metrics::set_default_local_recorder(&counts);

    // The loop's own timer: drain_over is cancelled shutdown_timeout + GRACE / 2 after
    // shutdown began.
    let d = dispatcher(Config::default()).await;
    let limit = d.config.dispatch.shutdown_timeout + crate::service::shutdown::GRACE / 2;
    d.start_drain_timer();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!d.drain_over.is_cancelled(), "no shutdown, no end of drain");
    d.shutdown.cancel();
    let began = Instant::now();
    d.drain_over.cancelled().await;
    let took = began.elapsed();
    assert!(
        took >= limit && took < limit + Duration::from_secs(1),
        "{took:?}"
    );

    // A removal whose delete would wait its whole operation_timeout (longer than the drain).
    let (_server, port) = silent_server();
    let store = silent_store(port, Duration::from_secs(600)).await;
    let health = Health::new(Duration::from_secs(1));
    let now = store.clock().now();
    let confirmed: Vec<(Bson, TimeoutRecord)> = (0..2).map(|n| sent(n, now)).collect();
    let lease = Lease::new(now, Duration::from_secs(3600));
    let (shutdown, drain_over) = (CancellationToken::new(), CancellationToken::new());
    shutdown.cancel();
    let (ending, over) = (drain_over.clone(), Instant::now() + limit);
    crate::host::spawn(async move {
        tokio::time::sleep_until(over).await;
        ending.cancel();
    });
    settle::remove(&store, &health, &confirmed, &lease, &shutdown, &drain_over).await;
    let now = Instant::now();
    assert!(
        now >= over && now < over + Duration::from_secs(1),
        "it gave up when the drain ended, not at its operation_timeout"
    );
    assert_eq!(counts.possible_duplicates(), 2);
}

/// Issue 25, 8.6: a wave whose link dropped reconnects first; that connect did not yield to
/// shutdown and held the loop's drain for up to `connect_timeout`. It yields now, and the
/// wave's records, not sent, are released.
#[tokio::test(start_paused = true)]
async fn a_waves_own_connect_yields_to_shutdown() {
    let (_server, port) = silent_server();
    let mut config = Config::default();
    config.rabbitmq.uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    config.rabbitmq.connect_timeout = Duration::from_secs(600);
    let mut d = dispatcher(config).await;
    // The link was up when the record fell due, and dropped before the wave's task ran (never
    // opened here): the wave starts as `start_work` starts it once it found the link up.
    d.link_up = true;
    let now = d.store.clock().now();
    d.held
        .push(ready(1, now, Lease::new(now, Duration::from_secs(300))));
    d.start_wave(now);
    assert_eq!(d.in_flight.len(), 1, "the wave started");
    tokio::time::sleep(Duration::from_secs(1)).await;
    d.shutdown.cancel();
    let done = tokio::time::timeout(Duration::from_secs(1), d.tasks.join_next())
        .await
        .expect("the wave ended at shutdown, not at its connect's deadline")
        .expect("the wave task")
        .expect("the wave task does not panic");
    let Done::Link {
        work: LinkWork::Wave { outcomes, .. },
        ..
    } = done
    else {
        panic!("not the wave's end");
    };
    assert!(
        matches!(outcomes.as_slice(), [SendOutcome::NotSent(_)]),
        "{outcomes:?}"
    );
}

/// Issue 25, 8.3, seen from outside: 20,000 records of a queue that is gone beside a live
/// stream; the dead queue's records, oldest first, filled every claim, and their refusals
/// (each counted and deferred, one write each) kept the claims busy: the live stream was not
/// delivered at all in two minutes (`tests/faults.rs`, `a_dead_queue_beside_a_live_stream`).
/// A destination the broker refused is now left out of this instance's claims for
/// `[retry] base`; a confirmed send to it ends that at once.
#[tokio::test(start_paused = true)]
async fn a_destination_that_refuses_sends_is_left_out_of_claims_for_a_while() {
    fn wave(d: &mut Dispatcher, n: i32, destination: &str, outcome: SendOutcome) {
        let now = d.store.clock().now();
        let mut r = ready(n, now, Lease::new(now, Duration::from_secs(300)));
        r.record.destination = destination.into();
        d.in_flight.push(r);
        d.on_wave_sent(vec![outcome], vec![None], Duration::ZERO);
    }
    let config = Config::default();
    let base = config.retry.base;
    let mut d = dispatcher(config).await;
    d.link_up = true;
    assert!(d.excluded_destinations().is_empty());
    wave(&mut d, 1, "gone", SendOutcome::Returned);
    wave(&mut d, 2, "full", SendOutcome::Nacked);
    wave(&mut d, 3, "live", SendOutcome::Confirmed);
    let mut excluded = d.excluded_destinations();
    excluded.sort();
    assert_eq!(
        excluded,
        ["full", "gone"],
        "refusing destinations are left out"
    );
    tokio::time::advance(base).await;
    assert!(
        d.excluded_destinations().is_empty(),
        "tried again after [retry] base"
    );
    wave(&mut d, 4, "gone", SendOutcome::Returned);
    assert_eq!(d.excluded_destinations(), ["gone"]);
    // Its refusals take a while to settle: the window runs from the last one settled.
    d.settling = 1;
    tokio::time::advance(base - Duration::from_millis(1)).await;
    d.on_finished(Done::Settled {
        refused: Some("gone".into()),
    });
    tokio::time::advance(Duration::from_millis(2)).await;
    assert_eq!(
        d.excluded_destinations(),
        ["gone"],
        "left out until [retry] base after its last refusal settled"
    );
    wave(&mut d, 5, "gone", SendOutcome::Confirmed);
    assert!(
        d.excluded_destinations().is_empty(),
        "a confirmed send ends it (the queue is back)"
    );
}

/// Simulation seed 5067: a wave that outlived its 3 s lease (publish_timeout 5 s) waited for a
/// withheld confirm while a claim of the same instance took the record again; when the wave
/// gave up on it, the held copy went out in the next wave 2 ms later, past the hold-off after
/// unconfirmed waves. The held copy is released with the rest now.
#[tokio::test(start_paused = true)]
async fn a_copy_claimed_again_during_an_unconfirmed_wave_waits_for_the_hold_off() {
    let mut d = dispatcher(Config::default()).await;
    d.link_up = true;
    let now = d.store.clock().now();
    let old = Lease::new(now, Duration::from_secs(3));
    let new = Lease::new(now, Duration::from_secs(300));
    d.in_flight.push(ready(1, now, old));
    d.held.push(ready(1, now, new));
    d.held.push(ready(2, now, new));
    d.on_wave_sent(vec![SendOutcome::TimedOut], vec![None], Duration::ZERO);
    let held: Vec<Bson> = d
        .held
        .take_matching(|_| true)
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(held, [Bson::Int32(2)], "the copy of record 1 is released");
    let released: Vec<String> = d
        .settle
        .work()
        .map(|s| match s {
            Settle::Release { ids, .. } => format!("{ids:?}"),
            _ => "other".into(),
        })
        .collect();
    assert!(
        released.iter().any(|r| r.contains("Int32(1)")),
        "{released:?}"
    );
}
