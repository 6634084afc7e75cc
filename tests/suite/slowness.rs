//! Slowness: a database or a broker that answers late, or holds every byte without closing
//! anything, rather than one that cuts the connection. Each scenario runs real timeoutd
//! processes whose links go through their own proxies ([`Mode::Delay`], [`Mode::Stall`]),
//! puts the fault on every one of them at start-up or in the middle of a drain, on an empty
//! collection (records written once the fault is over) or a full one, and then asserts:
//! - every record is delivered once the fault ends, none lost, every duplicate counted in
//!   `timeoutd_possible_duplicates_total` ([`audit`]);
//! - every instance still dispatches on its own afterwards ([`each_alone_delivers`]): a
//!   wedged instance cannot hide behind a peer that sent everything;
//! - where the fault stops an instance from working (a stall, a link it cannot open), its
//!   `/readyz` says so during the fault.
//!
//! Short deadlines (`operation_timeout`, `publish_timeout`, `connect_timeout` 2 s) and short
//! faults keep the file to a few minutes. Each test prints one `FAULTS` line
//! (`scripts/fault-table.sh`).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::doc;
use common::fleet::{Daemon, DeliveryCounter};
use common::proxy::{Mode, Proxy};
use common::scenario::*;
use common::*;
use uuid::Uuid;

/// `operation_timeout`, `publish_timeout` and `connect_timeout` in every scenario.
const DEADLINE: Duration = Duration::from_secs(2);
/// A reply delay that keeps a round trip a little under [`DEADLINE`].
const NEAR: Duration = Duration::from_millis(1_600);
/// A reply delay past [`DEADLINE`].
const PAST: Duration = Duration::from_millis(2_500);
/// How long each fault lasts (the fault itself, not a wait for an outcome).
const FAULT: Duration = Duration::from_secs(8);

/// Which link of each instance the fault is on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Link {
    MongoDb,
    RabbitMq,
}

/// When the fault begins.
#[derive(Clone, Copy, PartialEq, Eq)]
enum When {
    /// Before the instances start: they start into it.
    Start,
    /// Once the fleet is ready and, when records were written before, has sent some of them
    /// and is still sending (in the middle of a drain).
    Running,
}

/// What is written once the fault is over.
#[derive(Clone, Copy)]
enum After {
    Nothing,
    /// `n` records due now.
    Burst(usize),
    /// `per_second` records a second for `seconds`, each due `due_in` after it is written
    /// (the first report: 20 a second, due 1.5 s later).
    Trickle {
        per_second: usize,
        seconds: usize,
        due_in: Duration,
    },
}

struct Plan {
    scenario: &'static str,
    link: Link,
    fault: Mode,
    when: When,
    instances: usize,
    /// Records due now, written before the fault.
    before: usize,
    after: After,
    /// The fault stops the instances from working: each must answer `/readyz` 503 in it.
    not_ready_during: bool,
}

fn config(env: &TestEnv) -> timeoutd::config::Config {
    let mut c = fleet_config(env, secs(6), 100);
    c.mongodb.operation_timeout = DEADLINE;
    c.rabbitmq.publish_timeout = DEADLINE;
    c.rabbitmq.connect_timeout = DEADLINE;
    c
}

/// Writes `after`; returns the ids.
async fn write_after(env: &TestEnv, after: After) -> Vec<Uuid> {
    match after {
        After::Nothing => Vec::new(),
        After::Burst(n) => env.insert_due(n).await,
        After::Trickle {
            per_second,
            seconds,
            due_in,
        } => {
            // Every 100 ms a tenth of a second's records.
            let mut ids = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            for _ in 0..seconds * 10 {
                tick.tick().await;
                let batch: Vec<Uuid> = (0..per_second / 10).map(|_| Uuid::new_v4()).collect();
                let due = in_ms(due_in.as_millis() as i64);
                env.insert(
                    batch
                        .iter()
                        .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), due, doc! {}))
                        .collect(),
                )
                .await;
                ids.extend(batch);
            }
            ids
        }
    }
}

/// Runs one scenario; returns the duplicate deliveries and the lost leases counted.
async fn run(plan: Plan) -> (usize, f64) {
    let env = TestEnv::new().await;
    let counter = DeliveryCounter::start(&env.queue).await;
    let config = config(&env);
    let initial = match plan.when {
        When::Start => plan.fault,
        When::Running => Mode::Forward,
    };
    let mut proxies: Vec<Proxy> = Vec::new();
    let mut fleet: Vec<Daemon> = Vec::new();
    let mut ids = Vec::new();
    if plan.when == When::Start {
        ids.extend(env.insert_due(plan.before).await);
    }
    for i in 0..plan.instances {
        let name = ["a", "b", "c"][i];
        let (proxy, d) = match plan.link {
            Link::MongoDb => {
                let p = mongodb_proxy(initial).await;
                let d = spawn(name, &env, &config, None, Some(&p)).await;
                (p, d)
            }
            Link::RabbitMq => {
                let p = amqp_proxy(initial).await;
                let d = spawn(name, &env, &config, Some(&p), None).await;
                (p, d)
            }
        };
        proxies.push(proxy);
        fleet.push(d);
    }
    let fault_began = tokio::time::Instant::now();
    if plan.when == When::Running {
        for d in &fleet {
            assert!(d.ready_is(200, secs(30)).await, "{} ready", d.name);
        }
        ids.extend(env.insert_due(plan.before).await);
        assert!(
            counter.wait_distinct(plan.before / 10, secs(60)).await,
            "the fleet is sending"
        );
        for p in &proxies {
            p.set(plan.fault);
        }
        let left = env.count(doc! {}).await;
        if plan.before > 0 {
            assert!(left > 0, "the fault began in the middle of the drain");
            eprintln!(
                "{}: {left} records left when the fault began",
                plan.scenario
            );
        }
    }
    let fault_began = match plan.when {
        When::Start => fault_began,
        When::Running => tokio::time::Instant::now(),
    };
    if plan.not_ready_during {
        for d in &fleet {
            assert!(
                d.ready_is(503, FAULT).await,
                "{} answers /readyz 503 while it cannot work; its last notices: {:#?}",
                d.name,
                last_notices(d, 15)
            );
        }
    }
    tokio::time::sleep_until(fault_began + FAULT).await;
    if plan.not_ready_during {
        // Still so at the end of the fault, and live (a restart would not help).
        for d in &fleet {
            let (code, body) = d.get("/readyz").await;
            assert_eq!(
                code, 503,
                "{} not ready at the end of the fault: {body}",
                d.name
            );
            let (code, body) = d.get("/healthz").await;
            assert_eq!(code, 200, "{} live in the fault: {body}", d.name);
        }
    }
    for p in &proxies {
        p.set(Mode::Forward);
    }

    ids.extend(write_after(&env, plan.after).await);
    let all_sent = counter.wait_distinct(ids.len(), secs(180)).await;
    if !all_sent {
        let mut state = Vec::new();
        for d in &fleet {
            // A process that exited answers nothing: say so rather than panic in the GET.
            let url = format!("{}/readyz", d.base);
            let (code, body) = tokio::spawn(common::fleet::http_get(url))
                .await
                .unwrap_or((0, "no answer: the process is gone".into()));
            state.push(format!(
                "{}: /readyz {code} {body}; last notices: {:#?}",
                d.name,
                last_notices(d, 12)
            ));
        }
        panic!(
            "{}: {} of {} records delivered after the fault; {} still stored, {} leased\n{}",
            plan.scenario,
            counter.distinct(),
            ids.len(),
            env.count(doc! {}).await,
            env.count(doc! { "Locked": true }).await,
            state.join("\n")
        );
    }
    assert!(empty(&env, secs(30)).await, "every record removed");
    let refs: Vec<&Daemon> = fleet.iter().collect();
    ids.extend(each_alone_delivers(&env, &refs, &counter, 20).await);

    let mut lease_lost = 0.0;
    for d in &fleet {
        lease_lost += d.idle_duplicates().await;
    }
    for d in fleet {
        d.stop().await;
    }
    counter.settle(secs(1)).await;
    let duplicates = audit(
        plan.scenario,
        &ids,
        &counter,
        lease_lost,
        &Default::default(),
    );
    counter.close().await;
    env.cleanup().await;
    (duplicates, lease_lost)
}

/// The first report: `time_encoding = "auto"`, an empty collection, every reply of
/// the database slowed to a little under `operation_timeout` for a while (a claim's first
/// read of the collection's `Time` shapes then outlives the claim's deadline), then full
/// speed and 20 records a second, each due 1.5 s later. Two instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_database_near_the_deadline_then_records_on_an_empty_collection() {
    run(Plan {
        scenario: "MongoDB slow, near the deadline, empty collection; then 20 records/s",
        link: Link::MongoDb,
        fault: Mode::slow_replies(NEAR),
        when: When::Running,
        instances: 2,
        before: 0,
        after: After::Trickle {
            per_second: 20,
            seconds: 5,
            due_in: Duration::from_millis(1_500),
        },
        not_ready_during: false,
    })
    .await;
}

/// A database whose replies each take under a quarter of `operation_timeout` at start-up, on
/// a full collection: every call is in time, and so is the first read of the server's clock
/// (a connection's handshake and three `hello`s), but start-up's sequence of calls (the
/// deployment check, the index list and four index creations) is not. One instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_database_at_start_on_a_full_collection() {
    run(Plan {
        scenario: "MongoDB slow at start (each reply 0.45 s), full collection",
        link: Link::MongoDb,
        fault: Mode::slow_replies(Duration::from_millis(450)),
        when: When::Start,
        instances: 1,
        before: 1_000,
        after: After::Nothing,
        not_ready_during: false,
    })
    .await;
}

/// Every reply of the database past `operation_timeout`, in the middle of a drain: claims,
/// deletes and the background reads all time out (the writes still reach the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_database_past_the_deadline_in_the_middle_of_a_drain() {
    run(Plan {
        scenario: "MongoDB slow, past the deadline, mid-drain",
        link: Link::MongoDb,
        fault: Mode::slow_replies(PAST),
        when: When::Running,
        instances: 2,
        before: 3_000,
        after: After::Nothing,
        not_ready_during: false,
    })
    .await;
}

/// The database holds every byte, both ways, and closes nothing, in the middle of a drain.
/// Every instance must stop reporting ready (the issue saw one stay at 200 throughout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_database_in_the_middle_of_a_drain() {
    run(Plan {
        scenario: "MongoDB stalled, mid-drain",
        link: Link::MongoDb,
        fault: Mode::Stall,
        when: When::Running,
        instances: 2,
        before: 3_000,
        after: After::Nothing,
        not_ready_during: true,
    })
    .await;
}

/// The database stalled while the instance starts, on an empty collection; records written
/// once it answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_database_at_start_then_records_on_an_empty_collection() {
    let (duplicates, lease_lost) = run(Plan {
        scenario: "MongoDB stalled at start, empty collection; then 200 records",
        link: Link::MongoDb,
        fault: Mode::Stall,
        when: When::Start,
        instances: 1,
        before: 0,
        after: After::Burst(200),
        not_ready_during: true,
    })
    .await;
    assert_eq!(
        (duplicates, lease_lost),
        (0, 0.0),
        "nothing was in flight: exactly once"
    );
}

/// Every reply of the broker (the confirms) a little under `publish_timeout`, in the middle
/// of a drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_broker_near_the_deadline_in_the_middle_of_a_drain() {
    run(Plan {
        scenario: "RabbitMQ slow, near the deadline, mid-drain",
        link: Link::RabbitMq,
        fault: Mode::slow_replies(Duration::from_millis(1_500)),
        when: When::Running,
        instances: 2,
        before: 3_000,
        after: After::Nothing,
        not_ready_during: false,
    })
    .await;
}

/// Every reply of the broker past `publish_timeout` and `connect_timeout`, in the middle of a
/// drain: the publishes are routed, their confirms come too late, so their outcome is unknown
/// and they are released and sent again (each such duplicate counted as a lost lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_broker_past_the_deadline_in_the_middle_of_a_drain() {
    run(Plan {
        scenario: "RabbitMQ slow, past the deadline, mid-drain",
        link: Link::RabbitMq,
        fault: Mode::slow_replies(PAST),
        when: When::Running,
        instances: 2,
        before: 3_000,
        after: After::Nothing,
        not_ready_during: false,
    })
    .await;
}

/// The broker's replies past `connect_timeout` while the instance starts, on an empty
/// collection: it cannot open its link, so it is not ready; records written once the broker
/// is fast again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_broker_past_the_deadline_at_start_then_records_on_an_empty_collection() {
    let (duplicates, lease_lost) = run(Plan {
        scenario: "RabbitMQ slow at start, past the deadline, empty collection; then 200 records",
        link: Link::RabbitMq,
        fault: Mode::slow_replies(PAST),
        when: When::Start,
        instances: 1,
        before: 0,
        after: After::Burst(200),
        not_ready_during: true,
    })
    .await;
    assert_eq!(
        (duplicates, lease_lost),
        (0, 0.0),
        "nothing was in flight: exactly once"
    );
}
