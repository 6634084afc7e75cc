//! The deterministic simulation of a whole fleet (issue 25): models of MongoDB
//! ([`mongo`]) and RabbitMQ ([`rabbit`]), the swarm that draws a seed's world ([`swarm`]),
//! the fleet of real daemons run on them ([`fleet`]), the invariants ([`invariants`]) and the
//! trace ([`trace`]). `tests/simulate.rs` is the runner.
#![allow(dead_code)]

pub mod fleet;
#[path = "../common/hostile.rs"]
pub mod hostile;
pub mod invariants;
pub mod mongo;
pub mod rabbit;
pub mod swarm;
pub mod trace;

/// The one place that knows the models' own API: the fleet and the checker go through it.
pub mod models {
    use std::sync::Arc;
    use std::time::Duration;

    use bson::Document;
    use timeoutd::config::Config;
    use timeoutd::rabbit::link::Broker;
    use timeoutd::rabbit::publisher::Publisher;
    use timeoutd::store::Store;
    use timeoutd::store::backend::Backend;
    use timeoutd::store::clock::ServerClock;

    use super::mongo::{FaultPlan, Faults, Latency, MongoModel};
    use super::rabbit::{Behaviour, DownMode, RabbitModel};
    use super::swarm::Knobs;

    pub type Mongo = MongoModel;
    pub type Rabbit = RabbitModel;

    /// The RabbitMQ nodes of the simulated cluster (the daemon's `[rabbitmq] uri`).
    pub const NODES: [&str; 2] = ["amqp://sim-node-0:5672", "amqp://sim-node-1:5672"];

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// The faults every call may meet while faults are on, as the seed drew them.
    fn plan(k: &Knobs) -> FaultPlan {
        let (lo, hi) = k.mongo_latency_ms;
        FaultPlan {
            default: Faults {
                latency: Latency::Uniform(ms(lo), ms(hi)),
                reply_latency: Latency::Uniform(ms(lo / 2), ms(hi / 2)),
                per_document: k
                    .mongo_per_document_ms
                    .map(|(a, b)| Latency::Uniform(ms(a), ms(b))),
                p_cut: k.mongo_p_cut,
                p_lose_reply: k.mongo_p_lose_reply,
                p_error: k.mongo_p_error,
                error_code: 50,
                p_stall: k.mongo_p_stall,
                stall: Latency::Uniform(ms(k.op_timeout_ms / 2), ms(k.op_timeout_ms * 3)),
            },
            by_op: Default::default(),
        }
    }

    /// What the servers do once faults stop: answer, a little later.
    fn calm() -> FaultPlan {
        FaultPlan {
            default: Faults {
                latency: Latency::Uniform(Duration::from_micros(200), ms(2)),
                ..Faults::default()
            },
            by_op: Default::default(),
        }
    }

    pub fn new_mongo(database: &str, seed: u64, start_unix_ms: i64, k: &Knobs) -> Mongo {
        let m = MongoModel::new(database, seed, start_unix_ms);
        m.keep_log(false);
        m.set_faults(plan(k));
        m.set_error_after_effect(
            k.mongo_p_error_after_effect,
            &super::swarm::ERROR_AFTER_EFFECT_CODES,
        );
        if k.server_drift_ppm != 0 {
            m.set_drift_ppm(k.server_drift_ppm);
        }
        m
    }

    pub fn new_rabbit(seed: u64, queues: &[String], k: &Knobs) -> Rabbit {
        let b = Behaviour {
            ack_multiple: k.rabbit_ack_multiple,
            nack_rate: k.rabbit_nack_rate,
            ..Behaviour::default()
        };
        let model = RabbitModel::new(&NODES, seed, b);
        for (node, frame_max) in NODES.iter().zip(&k.node_frame_max) {
            model.set_frame_max(node, *frame_max);
        }
        for q in queues {
            model.declare_queue(q);
        }
        model
    }

    /// The MongoDB model as instance `i`'s client.
    pub fn backend(m: &Mongo, i: usize) -> Arc<dyn Backend> {
        Arc::new(m.client(&format!("i{i}")))
    }

    pub fn broker(r: &Rabbit) -> Arc<dyn Broker> {
        Arc::new(r.clone())
    }

    /// The documents of `collection` now, as the server holds them (no fault applies).
    pub fn docs(m: &Mongo, collection: &str) -> Vec<Document> {
        m.snapshot(collection)
    }

    /// One document by `_id`.
    pub fn doc(m: &Mongo, collection: &str, id: &bson::Bson) -> Option<Document> {
        m.get(collection, id)
    }

    /// The server's clock now, Unix milliseconds.
    pub fn server_ms(m: &Mongo) -> i64 {
        m.server_ms()
    }

    /// One operation of the operator, landing at once ([`MongoModel::run_direct`]).
    pub fn operate(
        m: &Mongo,
        collection: &str,
        op: &timeoutd::store::backend::Op,
    ) -> Result<timeoutd::store::backend::Reply, timeoutd::store::backend::MongoError> {
        m.run_direct(collection, op)
    }

    /// Inserts a record as a service would (not through any instance's wire).
    pub fn insert(m: &Mongo, collection: &str, doc: Document) {
        let _ = m.insert_direct(collection, vec![doc]);
    }

    /// Inserts a record just after the next claim read ran, before its reply
    /// ([`MongoModel::insert_during_next_claim`]); the receiver hears the server's clock then.
    pub fn insert_during_next_claim(
        m: &Mongo,
        collection: &str,
        doc: Document,
    ) -> tokio::sync::oneshot::Receiver<i64> {
        m.insert_during_next_claim(collection, doc)
    }

    /// Every message the broker routed to a queue: (its `MessageId`, its `CorrelationId`
    /// header, the connection name it came through).
    pub fn deliveries(r: &Rabbit) -> Vec<(Option<String>, Option<String>, String)> {
        r.deliveries()
            .into_iter()
            .map(|d| {
                (
                    d.message_id(),
                    d.header_str("CorrelationId"),
                    d.connection.clone(),
                )
            })
            .collect()
    }

    /// A fault of the MongoDB model, by the swarm's name for it; ends after `for_ms` (the
    /// liveness phase ends every one).
    pub fn mongo_fault(m: &Mongo, name: &str, arg: i64, for_ms: u64) {
        let d = ms(for_ms);
        match name {
            "clock_step" => m.step_clock_ms(arg),
            "drift" => m.set_drift_ppm(arg),
            "step_down" => m.step_down_for(d),
            "stall" => m.stall_client_for("", d),
            "cut" => m.cut_for(d),
            _ => {}
        }
    }

    /// A fault of the RabbitMQ model, by the swarm's name for it; undone after `for_ms`.
    pub fn rabbit_fault(r: &Rabbit, queues: &[String], name: &str, arg: i64, for_ms: u64) {
        let node = NODES[(arg.unsigned_abs() as usize) % NODES.len()];
        let queue = queues
            .get((arg.unsigned_abs() as usize) % queues.len().max(1))
            .cloned()
            .unwrap_or_default();
        match name {
            "node_down" => r.node_down(node, DownMode::Refuse),
            "node_hang" => r.node_down(node, DownMode::Hang),
            "stall_node" => r.stall_node(node, true),
            "alarm" => r.set_memory_alarm(node, true),
            "withhold" => r.set_queue_withholds(&queue, true, arg % 2 == 0),
            "nack" => r.set_queue_nacks(&queue, true),
            "close" => {
                let instance = arg.unsigned_abs() % 4;
                for link in r.links() {
                    if link.name.ends_with(&format!("#i{instance}")) {
                        r.close_connection(&link.name, "simulated");
                    }
                }
                return;
            }
            _ => return,
        }
        let (r, name) = (r.clone(), name.to_string());
        #[allow(clippy::disallowed_methods)]
        tokio::spawn(async move {
            tokio::time::sleep(ms(for_ms)).await;
            undo_rabbit(&r, &name, node, &queue);
        });
    }

    fn undo_rabbit(r: &Rabbit, name: &str, node: &str, queue: &str) {
        match name {
            "node_down" | "node_hang" => r.node_up(node),
            "stall_node" => r.stall_node(node, false),
            "alarm" => r.set_memory_alarm(node, false),
            "withhold" => r.set_queue_withholds(queue, false, false),
            "nack" => r.set_queue_nacks(queue, false),
            _ => {}
        }
    }

    /// Ends every model fault (the liveness phase).
    pub fn heal(m: &Mongo, r: &Rabbit, queues: &[String]) {
        m.heal();
        m.set_faults(calm());
        m.set_drift_ppm(0);
        for node in NODES {
            for name in ["node_down", "stall_node", "alarm"] {
                undo_rabbit(r, name, node, "");
            }
        }
        for q in queues {
            undo_rabbit(r, "withhold", "", q);
            undo_rabbit(r, "nack", "", q);
        }
        r.set_behaviour(|b| b.nack_rate = 0.0);
    }

    pub fn store(config: &Config, backend: Arc<dyn Backend>) -> Store {
        Store::with_backend(backend, &config.mongodb, ServerClock::default()).with_settings(config)
    }

    pub fn publisher(
        config: &Config,
        broker: Arc<dyn Broker>,
    ) -> Result<Publisher, timeoutd::rabbit::publisher::PublishError> {
        Ok(Publisher::with_broker(&config.rabbitmq, broker))
    }
}
