//! Unit tests of the dispatch loop's handling of the RabbitMQ link, over a fake broker
//! ([`crate::dispatch::publisher::tests::fake`]); MongoDB is never contacted.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Dispatcher, Done, Signals};
use crate::config::Config;
use crate::dispatch::publisher::Publisher;
use crate::dispatch::publisher::tests::fake::FakeBroker;
use crate::service::health::Health;
use crate::store::Store;
use crate::store::clock::ServerClock;

async fn over_fake_broker(broker: Arc<FakeBroker>) -> (Dispatcher, Arc<Health>, CancellationToken) {
    let config = Config::default();
    let store = Store::connect(&config.mongodb, ServerClock::default())
        .await
        .expect("store");
    let publisher = Publisher::with_broker(&config.rabbitmq, broker);
    let health = Arc::new(Health::new(config.dispatch.poll_interval));
    let shutdown = CancellationToken::new();
    let d = Dispatcher::new(
        Arc::new(config),
        store,
        Arc::default(),
        publisher,
        health.clone(),
        shutdown.clone(),
        Signals::default(),
    );
    (d, health, shutdown)
}

/// Issue 25: a connect cut short by shutdown reported success, and marked RabbitMQ up
/// (`/readyz`, `timeoutd_dependency_up`) though nothing ever answered. Here the node never
/// answers the open.
#[tokio::test]
async fn a_connect_cut_short_by_shutdown_does_not_mark_rabbitmq_up() {
    let (mut d, health, shutdown) = over_fake_broker(Arc::new(FakeBroker::default())).await;
    d.start_connect();
    shutdown.cancel();
    let connected = tokio::time::timeout(Duration::from_secs(20), d.tasks.join_next())
        .await
        .expect("the connect ends at shutdown")
        .expect("a connect task")
        .expect("the connect task does not panic");
    d.on_finished(connected);
    assert!(!d.link_up);
    assert!(
        health
            .readiness()
            .problems
            .contains(&"rabbitmq unreachable"),
        "{:?}",
        health.readiness()
    );
}

fn the_link_task_panics() -> Done {
    panic!("the link task panics (test)")
}

/// Issue 25, 8.8: after the task that owned the link died, the publisher was built afresh with
/// a watch of its own while the loop kept reading the old one: `connection.blocked` went unseen
/// from then on. The recreated publisher shows its links to the loop's watch.
#[tokio::test]
async fn the_blocked_watch_follows_a_publisher_recreated_after_its_task_died() {
    let broker = Arc::new(FakeBroker::default());
    let status = broker.link(Vec::new(), None);
    let (mut d, health, _shutdown) = over_fake_broker(broker).await;
    let owned = d.publisher.take();
    let handle = crate::host::spawn_in(&mut d.tasks, async move {
        drop(owned);
        the_link_task_panics()
    });
    d.link_task = Some(handle.id());
    let died = tokio::time::timeout(Duration::from_secs(20), d.tasks.join_next())
        .await
        .expect("the task ends")
        .expect("a task");
    let Err(died) = died else {
        panic!("the link task was to panic");
    };
    d.on_task_died(died);
    assert!(d.publisher.is_some(), "recreated");

    d.start_connect();
    let connected = tokio::time::timeout(Duration::from_secs(20), d.tasks.join_next())
        .await
        .expect("the connect ends")
        .expect("a connect task")
        .expect("the connect task does not panic");
    d.on_finished(connected);
    assert!(d.link_up, "the new publisher's link is open");

    status.set_blocked(true);
    d.check_blocked();
    assert!(d.blocked, "the loop sees the new link blocked");
    assert!(
        health
            .readiness()
            .problems
            .iter()
            .any(|p| p.starts_with("rabbitmq blocked")),
        "{:?}",
        health.readiness()
    );
}
