//! What one seed draws ("swarm" testing, as TigerBeetle's VOPR does): the configuration, the
//! instances, the records and the faults over time. A [`Scenario`] is plain data, written to
//! and read from a JSON file, so that a failing seed shrinks to a small scenario kept under
//! `tests/sim/regressions/` and replayed by the test.

use serde::{Deserialize, Serialize};
use timeoutd::store::clock::MAX_DRIFT_PPM;

/// A small deterministic generator (splitmix64): the scenario depends on the seed only.
#[derive(Debug, Clone)]
pub struct Draw(u64);

impl Draw {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x005E_ED0F_7133_0C7D)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        let i = self.range(0, items.len().saturating_sub(1) as u64) as usize;
        &items[i]
    }
}

/// The configuration a seed draws (everything timeoutd reads that changes a schedule).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Knobs {
    /// "auto", "dotnet-ticks" or "date".
    pub time_encoding: String,
    pub lease_ms: u64,
    pub margin_ms: u64,
    pub poll_ms: u64,
    /// `None`: twice the poll interval.
    pub look_ahead_ms: Option<u64>,
    pub batch_size: u32,
    pub op_timeout_ms: u64,
    pub publish_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub shutdown_timeout_ms: u64,
    /// "stable" or "random".
    pub message_id: String,
    pub max_rate: Option<f64>,
    /// Per-destination send-rate limits.
    pub destination_rates: Vec<(String, f64)>,
    pub retry_base_ms: u64,
    pub retry_cap_ms: u64,
    pub max_attempts: u32,
    /// MongoDB model, while faults are on: the server's time per operation (min, max), the
    /// pause before each document of a multi-document write, and the chances of a request
    /// cut, a lost reply, a `maxTimeMS` error (code 50), a long stall.
    pub mongo_latency_ms: (u64, u64),
    pub mongo_per_document_ms: Option<(u64, u64)>,
    pub mongo_p_cut: f64,
    pub mongo_p_lose_reply: f64,
    pub mongo_p_error: f64,
    pub mongo_p_stall: f64,
    /// The chance that a write takes effect and still answers a write concern error (one of
    /// [`ERROR_AFTER_EFFECT_CODES`]), while faults are on
    /// ([`crate::sim::mongo::AfterEffect`]; [`Scenario::draw_error_after_effect`]).
    #[serde(default)]
    pub mongo_p_error_after_effect: f64,
    /// The server clock's drift while faults are on (parts per million).
    pub server_drift_ppm: i64,
    /// RabbitMQ model: the chance an ack waits for a multiple-ack, and of a nack.
    pub rabbit_ack_multiple: f64,
    pub rabbit_nack_rate: f64,
    /// The `frame_max` each RabbitMQ node offers, by node (empty: RabbitMQ's default on
    /// every node). A cluster whose nodes differ makes a failover change the limit a wave
    /// must be built against.
    #[serde(default)]
    pub node_frame_max: Vec<u32>,
}

/// One instance of timeoutd: when it starts and how wrong its host's clock is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InstanceSpec {
    pub start_at_ms: u64,
    pub skew_ms: i64,
}

/// What a record is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum RecordKind {
    /// A ServiceConnect v7 record (`Time` as ticks at offset 0, standard GUIDs) or a public
    /// one (`Time` a date, C# legacy GUIDs), whichever the encoding serves, to a bound queue.
    Ordinary { destination: usize },
    /// An ordinary record to a queue nothing is bound to: retried, then parked.
    Unroutable,
    /// A hostile document from `tests/common/hostile.rs`, drawn from this seed.
    Hostile { seed: u64 },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecordSpec {
    pub kind: RecordKind,
    /// Due this long after the simulation's start (negative: already overdue).
    pub due_ms: i64,
    /// Inserted this long after the start (0: before any instance starts).
    pub insert_at_ms: u64,
    /// Bytes of padding in its stored `Headers` (0: none): near the smaller node's
    /// `frame_max`, a record fits one node's frames and not the other's.
    #[serde(default)]
    pub header_bytes: u32,
    /// Due in the calm after the faults, when nothing delays it but the configuration: it
    /// must reach the broker on time (the `late` invariant, [`Scenario::on_time_ms`]).
    #[serde(default)]
    pub on_time: bool,
    /// Inserted just after the first claim read that runs at or after `insert_at_ms`, before
    /// that read's reply: its insert wake-up comes while the claim runs
    /// ([`crate::sim::mongo::MongoModel::insert_during_next_claim`]).
    #[serde(default)]
    pub during_claim: bool,
    /// 100 ns ticks past `due_ms` (0 to 9,999), for a `Time` stored as .NET ticks, which .NET
    /// writes to 100 ns: the record is due at the first millisecond at or after them
    /// ([`Scenario::draw_ticks`]).
    #[serde(default)]
    pub due_ticks: u16,
}

/// A fault, at an instant of the simulation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum FaultKind {
    /// kill -9: the instance's tasks are dropped where they are, its calls never answer, its
    /// leases remain. A new instance takes its place at the end of the faults.
    Kill { instance: usize },
    /// SIGTERM: its shutdown token is cancelled (it drains). Restarted at the end.
    Sigterm { instance: usize },
    /// The instance stops (a GC pause, a VM freeze): its calls and their answers are held.
    Pause { instance: usize, for_ms: u64 },
    /// The host's wall clock steps by `ms` (NTP, VM resume).
    ClockStep { instance: usize, ms: i64 },
    /// Calls from the instance to MongoDB answer `delay_ms` late for `for_ms` (the request
    /// runs on the server at once; its answer is late, or lost if the client gave up).
    MongoSlow {
        instance: usize,
        delay_ms: u64,
        for_ms: u64,
    },
    /// Calls from the instance to MongoDB fail with a network error for `for_ms`.
    MongoCut { instance: usize, for_ms: u64 },
    /// The instance's link to RabbitMQ is lost (status closed, publishes fail, unanswered
    /// confirms fail) for `for_ms`: reconnects fail meanwhile.
    RabbitCut { instance: usize, for_ms: u64 },
    /// The broker withholds the instance's confirms for `for_ms` (they resolve late).
    RabbitWithhold { instance: usize, for_ms: u64 },
    /// `connection.blocked` on the instance's link for `for_ms`.
    RabbitBlocked { instance: usize, for_ms: u64 },
    /// A fault of the MongoDB model itself (server clock step or drift, step-down, stall,
    /// cut of every client), by name, for `for_ms`.
    MongoModel { name: String, arg: i64, for_ms: u64 },
    /// A fault of the RabbitMQ model itself (a node down, unreachable or stalled, a memory
    /// alarm, a queue withholding confirms or nacking, a connection closed), for `for_ms`.
    RabbitModel { name: String, arg: i64, for_ms: u64 },
}

/// What an operator does to one record (by its index in [`Scenario::records`]), as
/// `timeoutd reschedule` and `timeoutd cancel` do: only while the record is free, and only
/// if its `Time` is still what was read.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ActionKind {
    /// Moves the record's due instant by `by_ms` (negative: earlier).
    Reschedule { record: usize, by_ms: i64 },
    /// Deletes the record.
    Cancel { record: usize },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Action {
    pub at_ms: u64,
    pub kind: ActionKind,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Fault {
    pub at_ms: u64,
    pub kind: FaultKind,
}

/// One seed's whole world.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Scenario {
    pub seed: u64,
    pub knobs: Knobs,
    /// Unix milliseconds of the simulated start (the server's clock).
    pub start_unix_ms: i64,
    pub instances: Vec<InstanceSpec>,
    /// The bound destinations (queues), by index.
    pub destinations: Vec<String>,
    pub records: Vec<RecordSpec>,
    pub faults: Vec<Fault>,
    /// The operator's reschedules and cancels (none in scenario files written before they
    /// were drawn).
    #[serde(default)]
    pub actions: Vec<Action>,
    /// The chance that a read of `Timeouts` by an instance is at once followed, before any
    /// other step, by the operator moving one of the records it returned later (each record
    /// once, while faults are on): a reschedule racing a claim between its read and its take.
    #[serde(default)]
    pub reschedule_on_read: f64,
    /// When the faults stop (every fault has ended by then); the liveness phase follows.
    pub faults_end_ms: u64,
}

/// How much later a reschedule racing a claim moves a record: from, to (ms).
pub const RACE_LATER_MS: (u64, u64) = (1_000, 20_000);

/// What a record due in the calm may take beyond what its configuration allows: the claim's
/// calls, the publish and its confirm, and the widening of the server clock's bounds since
/// the last reading (1 ms a second).
pub const ON_TIME_SLACK_MS: u64 = 250;

/// The write concern errors a write that took effect answers: WriteConcernFailed (a
/// wtimeout, not retried), ShutdownInProgress, PrimarySteppedDown and
/// InterruptedDueToReplStateChange (retried by the driver on a retryable write).
pub const ERROR_AFTER_EFFECT_CODES: [i32; 4] = [64, 91, 189, 11602];

/// The queue nothing is bound to.
pub const UNROUTABLE: &str = "sim-unbound";

impl Scenario {
    /// Draws the scenario of `seed`.
    pub fn draw(seed: u64) -> Self {
        let mut d = Draw::new(seed);
        let poll_ms = *d.pick(&[50, 200, 500, 1000, 2000]);
        let lease_ms = *d.pick(&[3_000, 5_000, 10_000, 30_000, 60_000]);
        // The lease must outlast the margin, a poll and the publish timeout (validated too).
        let margin_ms = d.range(100, (lease_ms / 4).max(200));
        let publish_timeout_ms = *d.pick(&[300, 1000, 3000, 5000]);
        let op_timeout_ms = *d.pick(&[200, 1000, 2000, 5000]);
        let knobs = Knobs {
            time_encoding: d.pick(&["auto", "dotnet-ticks", "date"]).to_string(),
            lease_ms,
            margin_ms,
            poll_ms,
            look_ahead_ms: if d.chance(0.5) {
                None
            } else {
                Some(*d.pick(&[0, 100, 1000, 5000]))
            },
            batch_size: *d.pick(&[1, 2, 7, 50, 500]),
            op_timeout_ms,
            publish_timeout_ms,
            connect_timeout_ms: *d.pick(&[300, 1000, 5000]),
            shutdown_timeout_ms: *d.pick(&[500, 2000, 10_000]),
            message_id: d.pick(&["stable", "random"]).to_string(),
            max_rate: if d.chance(0.2) {
                Some(*d.pick(&[5.0, 50.0, 500.0]))
            } else {
                None
            },
            destination_rates: if d.chance(0.2) {
                vec![("sim-q0".to_string(), *d.pick(&[2.0, 20.0]))]
            } else {
                Vec::new()
            },
            retry_base_ms: *d.pick(&[50, 200, 1000]),
            retry_cap_ms: 5_000,
            max_attempts: d.range(1, 4) as u32,
            mongo_latency_ms: *d.pick(&[(0, 1), (1, 5), (5, 50), (20, 400)]),
            mongo_per_document_ms: if d.chance(0.4) {
                Some(*d.pick(&[(0, 1), (1, 20)]))
            } else {
                None
            },
            mongo_p_cut: *d.pick(&[0.0, 0.0, 0.01, 0.05]),
            mongo_p_lose_reply: *d.pick(&[0.0, 0.0, 0.01, 0.05]),
            mongo_p_error: *d.pick(&[0.0, 0.0, 0.01, 0.03]),
            mongo_p_stall: *d.pick(&[0.0, 0.0, 0.0, 0.01]),
            mongo_p_error_after_effect: 0.0,
            // A server clock slower than this host's by as much as timeoutd allows for
            // (`MAX_DRIFT_PPM`, which `ServerClock::earliest` widens by): the edge of what it
            // must hold. Faster clocks are bounded by the lease margin instead.
            server_drift_ppm: *d.pick(&[0, 0, 0, 100, -MAX_DRIFT_PPM, 2_000]),
            rabbit_ack_multiple: *d.pick(&[0.0, 0.3, 0.8]),
            rabbit_nack_rate: *d.pick(&[0.0, 0.0, 0.0, 0.02]),
            node_frame_max: Vec::new(),
        };
        let mut knobs = knobs;
        // What validation asks: a lease longer than the margin, a poll and the look-ahead.
        let look_ahead = knobs.look_ahead_ms.unwrap_or(2 * knobs.poll_ms);
        let needed = knobs.margin_ms + knobs.poll_ms + look_ahead;
        if knobs.lease_ms <= needed {
            knobs.lease_ms = needed + 1_000;
        }
        let lease_ms = knobs.lease_ms;
        let n_instances = d.range(1, 4) as usize;
        let instances = (0..n_instances)
            .map(|i| InstanceSpec {
                start_at_ms: if i == 0 { 0 } else { d.range(0, 3_000) },
                skew_ms: if d.chance(0.3) {
                    d.range(0, 20_000) as i64 - 10_000
                } else {
                    0
                },
            })
            .collect();
        let destinations: Vec<String> = (0..d.range(1, 3)).map(|i| format!("sim-q{i}")).collect();
        let faults_end_ms = d.range(5_000, 60_000);
        let n_records = d.range(1, 120) as usize;
        let hostile_p = if d.chance(0.3) { 0.15 } else { 0.0 };
        let unroutable_p = if d.chance(0.3) { 0.1 } else { 0.0 };
        let records: Vec<RecordSpec> = (0..n_records)
            .map(|_| {
                let kind = if d.chance(hostile_p) {
                    RecordKind::Hostile { seed: d.next() }
                } else if d.chance(unroutable_p) {
                    RecordKind::Unroutable
                } else {
                    RecordKind::Ordinary {
                        destination: d.range(0, destinations.len() as u64 - 1) as usize,
                    }
                };
                RecordSpec {
                    kind,
                    due_ms: d.range(0, faults_end_ms + 5_000) as i64 - 2_000,
                    insert_at_ms: if d.chance(0.7) {
                        0
                    } else {
                        d.range(0, faults_end_ms)
                    },
                    header_bytes: 0,
                    on_time: false,
                    during_claim: false,
                    due_ticks: 0,
                }
            })
            .collect();
        let fault_rate = *d.pick(&[0.0, 0.5, 2.0, 6.0]);
        let n_faults = ((faults_end_ms as f64 / 10_000.0) * fault_rate).round() as usize;
        let mut faults = Vec::new();
        for _ in 0..n_faults {
            let at_ms = d.range(0, faults_end_ms.saturating_sub(1));
            let left = faults_end_ms - at_ms;
            let instance = d.range(0, n_instances as u64 - 1) as usize;
            let for_ms = d.range(1, left.min(30_000));
            let kind = match d.range(0, 11) {
                0 => FaultKind::Kill { instance },
                1 => FaultKind::Sigterm { instance },
                2 => FaultKind::Pause {
                    instance,
                    for_ms: d.range(1, left.min(lease_ms * 2)),
                },
                3 => FaultKind::ClockStep {
                    instance,
                    ms: d.range(0, 120_000) as i64 - 60_000,
                },
                4 | 5 => FaultKind::MongoSlow {
                    instance,
                    delay_ms: *d.pick(&[
                        op_timeout_ms / 2,
                        op_timeout_ms.saturating_sub(10),
                        op_timeout_ms + 10,
                        op_timeout_ms * 3,
                    ]),
                    for_ms,
                },
                6 => FaultKind::MongoCut { instance, for_ms },
                7 => FaultKind::RabbitCut { instance, for_ms },
                8 => FaultKind::RabbitWithhold { instance, for_ms },
                9 => FaultKind::RabbitBlocked { instance, for_ms },
                10 => {
                    let name = *d.pick(&["clock_step", "drift", "step_down", "stall", "cut"]);
                    let arg = match name {
                        // A server clock step smaller than the margin: a larger one breaks
                        // any lease on the server's clock, whatever the client does.
                        "clock_step" => d.range(0, margin_ms) as i64 - (margin_ms / 2) as i64,
                        "drift" => *d.pick(&[-MAX_DRIFT_PPM, 500, 5_000]),
                        _ => 0,
                    };
                    FaultKind::MongoModel {
                        name: name.to_string(),
                        arg,
                        for_ms: d.range(1, left.min(10_000)),
                    }
                }
                _ => FaultKind::RabbitModel {
                    name: d
                        .pick(&[
                            "node_down",
                            "node_hang",
                            "stall_node",
                            "alarm",
                            "withhold",
                            "nack",
                            "close",
                        ])
                        .to_string(),
                    arg: d.range(0, 7) as i64,
                    for_ms: d.range(1, left.min(10_000)),
                },
            };
            faults.push(Fault { at_ms, kind });
        }
        faults.sort_by_key(|f| f.at_ms);
        let actions = Self::draw_actions(seed, records.len(), faults_end_ms);
        let reschedule_on_read = {
            let mut d = Draw::new(seed ^ 0x00AC_E0F2_EAD5);
            if d.chance(0.3) {
                *d.pick(&[0.05, 0.2, 0.5])
            } else {
                0.0
            }
        };
        let mut records = records;
        Self::draw_frames(seed, &mut knobs, &mut records);
        let on_time = Self::draw_on_time(seed, &knobs, destinations.len(), &faults, faults_end_ms);
        records.extend(on_time);
        Self::draw_ticks(seed, &mut records);
        Self::draw_error_after_effect(seed, &mut knobs);
        Scenario {
            seed,
            knobs,
            start_unix_ms: 1_767_225_600_000 + d.range(0, 86_400_000) as i64,
            instances,
            destinations,
            records,
            faults,
            actions,
            reschedule_on_read,
            faults_end_ms,
        }
    }

    /// Half the records due between two milliseconds, as .NET's ticks put them: the checker
    /// knows such a record due at the next millisecond, which timeoutd must work out from
    /// the ticks (rounded down, it went out up to 1 ms early). From a generator of its own,
    /// as [`Scenario::draw_actions`].
    fn draw_ticks(seed: u64, records: &mut [RecordSpec]) {
        let mut d = Draw::new(seed ^ 0x71C6_5000);
        for r in records.iter_mut() {
            if d.chance(0.5) {
                r.due_ticks = d.range(1, 9_999) as u16;
            }
        }
    }

    /// In one seed of three, writes that take effect and still answer a write concern error,
    /// at a modest rate: from a generator of its own, as [`Scenario::draw_actions`].
    fn draw_error_after_effect(seed: u64, knobs: &mut Knobs) {
        let mut d = Draw::new(seed ^ 0x0AF7_E2EF_FEC7);
        if d.chance(1.0 / 3.0) {
            knobs.mongo_p_error_after_effect = *d.pick(&[0.005, 0.02, 0.05]);
        }
    }

    /// In two seeds of five, a cluster one of whose nodes offers a small `frame_max`, and
    /// records with headers about its size (some fit it, some only the first node's): from a
    /// generator of their own, as [`Scenario::draw_actions`].
    fn draw_frames(seed: u64, knobs: &mut Knobs, records: &mut [RecordSpec]) {
        let mut d = Draw::new(seed ^ 0xF4A3_E3A8);
        if !d.chance(0.4) {
            return;
        }
        let small = *d.pick(&[4_096u32, 8_192, 16_384]);
        // The small one first (where links open) or second (where a failover goes).
        knobs.node_frame_max = if d.chance(0.5) {
            vec![small, 131_072]
        } else {
            vec![131_072, small]
        };
        for r in records.iter_mut() {
            if matches!(r.kind, RecordKind::Ordinary { .. }) && d.chance(0.3) {
                r.header_bytes = d.range(u64::from(small / 2), u64::from(small) * 2) as u32;
            }
        }
    }

    /// When the calm after the faults begins, in ms after the start: every delay a fault can
    /// leave behind has run out by then. The longest is a claim paced after failures
    /// ([`timeoutd::store::pacing::RETRY_CAP`] and its `operation_timeout`); beside it a
    /// reconnect's back-off or the hold-off after unconfirmed publishes (10 s), a server
    /// clock reading taken before the faults stopped (the monitor's 15 s), a replaced
    /// instance's start-up and a stopped one's drain. After a RabbitMQ node hung, a link to
    /// it stays silent until the client's dead-peer timeout
    /// ([`crate::sim::rabbit::DEAD_PEER_TIMEOUT`]): a publish on it waits for its deadline,
    /// and what is held waits with it.
    fn calm_from_ms(k: &Knobs, faults: &[Fault], faults_end_ms: u64) -> u64 {
        let paced = timeoutd::store::pacing::RETRY_CAP.as_millis() as u64 + k.op_timeout_ms;
        let calls = 2 * (k.op_timeout_ms + k.publish_timeout_ms + k.connect_timeout_ms);
        let hung = faults
            .iter()
            .any(|f| matches!(&f.kind, FaultKind::RabbitModel { name, .. } if name == "node_hang"));
        let dead_peer = if hung {
            crate::sim::rabbit::DEAD_PEER_TIMEOUT.as_millis() as u64
        } else {
            0
        };
        faults_end_ms + paced.max(15_000).max(dead_peer) + calls + k.shutdown_timeout_ms
    }

    /// How late a record due in the calm may reach the broker, in ms: a claim reads
    /// `look_ahead` ahead every poll, so one due between two polls is read at most
    /// `poll - look_ahead` after its instant (at once, when a wake-up or the look-ahead has it
    /// held), plus [`ON_TIME_SLACK_MS`] for the calls.
    pub fn on_time_ms(&self) -> u64 {
        let k = &self.knobs;
        let look_ahead = k.look_ahead_ms.unwrap_or(2 * k.poll_ms);
        k.poll_ms.saturating_sub(look_ahead) + ON_TIME_SLACK_MS
    }

    /// In one seed of two without send-rate limits (which hold records back by design), one
    /// to four ordinary records due in the calm ([`Scenario::calm_from_ms`]), from a generator
    /// of their own (as [`Scenario::draw_actions`]): half stored from the start, half inserted
    /// shortly before they fall due, within or past the look-ahead, so that the insert
    /// wake-up or the next poll must find them in time.
    fn draw_on_time(
        seed: u64,
        knobs: &Knobs,
        destinations: usize,
        faults: &[Fault],
        faults_end_ms: u64,
    ) -> Vec<RecordSpec> {
        let mut d = Draw::new(seed ^ 0x0_0717_E000);
        if knobs.max_rate.is_some() || !knobs.destination_rates.is_empty() || !d.chance(0.5) {
            return Vec::new();
        }
        let calm = Self::calm_from_ms(knobs, faults, faults_end_ms);
        let look_ahead = knobs.look_ahead_ms.unwrap_or(2 * knobs.poll_ms);
        let mut due = calm + look_ahead + knobs.poll_ms;
        let mut records = (0..d.range(1, 4))
            .map(|_| {
                due += d.range(0, 3 * knobs.poll_ms + 500);
                let insert_at_ms = if d.chance(0.5) {
                    0
                } else {
                    due.saturating_sub(d.range(0, look_ahead + knobs.poll_ms))
                        .max(calm)
                };
                RecordSpec {
                    kind: RecordKind::Ordinary {
                        destination: d.range(0, destinations as u64 - 1) as usize,
                    },
                    due_ms: due as i64,
                    insert_at_ms,
                    header_bytes: 0,
                    on_time: true,
                    during_claim: false,
                    due_ticks: 0,
                }
            })
            .collect::<Vec<_>>();
        // Half of those inserted late land beside a claim, from a generator of their own.
        let mut c = Draw::new(seed ^ 0x0C1A_1D00);
        for r in records.iter_mut().filter(|r| r.insert_at_ms > 0) {
            r.during_claim = c.chance(0.5);
        }
        records
    }

    /// The operator's actions of `seed`, from a generator of their own (so that the rest of
    /// a seed's world is what it was before actions were drawn): in two seeds of five, a few
    /// reschedules (mostly later, by up to 20 s: a record read before the move must not be
    /// sent at its old instant) and cancels, while faults are on.
    fn draw_actions(seed: u64, records: usize, faults_end_ms: u64) -> Vec<Action> {
        let mut d = Draw::new(seed ^ 0x0A_C710_4500);
        if records == 0 || !d.chance(0.4) {
            return Vec::new();
        }
        let n = d.range(1, (records as u64 / 4).max(1));
        let mut actions: Vec<Action> = (0..n)
            .map(|_| {
                let record = d.range(0, records as u64 - 1) as usize;
                let kind = if d.chance(0.8) {
                    ActionKind::Reschedule {
                        record,
                        by_ms: d.range(0, 23_000) as i64 - 3_000,
                    }
                } else {
                    ActionKind::Cancel { record }
                };
                Action {
                    at_ms: d.range(0, faults_end_ms),
                    kind,
                }
            })
            .collect();
        actions.sort_by_key(|a| a.at_ms);
        actions
    }

    /// The bound on the liveness phase: once faults stop, every record is delivered or
    /// parked within this many milliseconds. A restart (start-up, a poll), a lease left by a
    /// killed instance (the lease, the reaper's interval), the retries of an unroutable
    /// record (their back-offs, each under a lease), a rate-limited backlog, and slack for
    /// the calls' deadlines.
    pub fn liveness_bound_ms(&self) -> u64 {
        let k = &self.knobs;
        let reaper = k.lease_ms / 4;
        let mut retries = 0u64;
        for attempt in 1..=u64::from(k.max_attempts) {
            let d = k.retry_base_ms.saturating_mul(1 << (attempt - 1).min(20));
            retries += d.min(k.retry_cap_ms) + k.lease_ms + k.poll_ms;
        }
        let n = self.records.len() as f64;
        let slowest_rate = k
            .destination_rates
            .iter()
            .map(|(_, r)| *r)
            .chain(k.max_rate)
            .fold(f64::INFINITY, f64::min);
        let rate_ms = if slowest_rate.is_finite() {
            (n / slowest_rate * 1000.0) as u64
        } else {
            0
        };
        let latest_due = self
            .records
            .iter()
            .map(|r| r.due_ms.max(0) as u64)
            .max()
            .unwrap_or(0)
            .saturating_add(self.rescheduled_later_ms())
            .saturating_sub(self.faults_end_ms);
        let calls = 10 * (k.op_timeout_ms + k.publish_timeout_ms + k.connect_timeout_ms);
        latest_due + 2 * k.lease_ms + reaper + retries + rate_ms + 10 * k.poll_ms + calls + 30_000
    }
}

impl Scenario {
    /// The most any record's due instant is moved later by the operator's reschedules.
    fn rescheduled_later_ms(&self) -> u64 {
        let mut by_record: std::collections::BTreeMap<usize, i64> = Default::default();
        for a in &self.actions {
            if let ActionKind::Reschedule { record, by_ms } = a.kind {
                *by_record.entry(record).or_default() += by_ms;
            }
        }
        let planned = by_record.values().copied().max().unwrap_or(0).max(0) as u64;
        let racing = if self.reschedule_on_read > 0.0 {
            RACE_LATER_MS.1
        } else {
            0
        };
        planned + racing
    }

    /// The smaller scenarios to try in place of this failing one, most promising first:
    /// without all faults, without each fault, without each half of the records, without
    /// each record (when few are left), without the last instance.
    pub fn smaller(&self) -> Vec<Scenario> {
        let mut out = self.without_each(|s| &mut s.faults);
        if self.reschedule_on_read > 0.0 {
            out.push(Scenario {
                reschedule_on_read: 0.0,
                ..self.clone()
            });
        }
        out.extend(self.without_each(|s| &mut s.actions));
        let n = self.records.len();
        if n > 1 {
            let half = n / 2;
            let mut a = self.clone();
            a.records.truncate(half);
            out.push(a);
            let mut b = self.clone();
            b.records.drain(..half);
            out.push(b);
        }
        if n > 1 && n <= 16 {
            for i in 0..n {
                let mut s = self.clone();
                s.records.remove(i);
                out.push(s);
            }
        }
        if self.instances.len() > 1 {
            let last = self.instances.len() - 1;
            let mut s = self.clone();
            s.instances.pop();
            s.faults.retain(|f| f.kind.instance() != Some(last));
            out.push(s);
        }
        out
    }

    /// Without all of the items `list` picks (faults, actions), then without each one.
    fn without_each<T>(&self, list: impl Fn(&mut Scenario) -> &mut Vec<T>) -> Vec<Scenario> {
        let mut probe = self.clone();
        let n = list(&mut probe).len();
        if n == 0 {
            return Vec::new();
        }
        let mut none = self.clone();
        list(&mut none).clear();
        let mut out = vec![none];
        for i in 0..n {
            let mut s = self.clone();
            list(&mut s).remove(i);
            out.push(s);
        }
        out
    }

    /// A size to compare shrunk scenarios by.
    pub fn size(&self) -> usize {
        self.faults.len() * 4
            + self.actions.len() * 2
            + self.records.len()
            + self.instances.len() * 2
    }
}

impl FaultKind {
    /// The instance a fault is on, if any.
    pub fn instance(&self) -> Option<usize> {
        match self {
            FaultKind::Kill { instance }
            | FaultKind::Sigterm { instance }
            | FaultKind::Pause { instance, .. }
            | FaultKind::ClockStep { instance, .. }
            | FaultKind::MongoSlow { instance, .. }
            | FaultKind::MongoCut { instance, .. }
            | FaultKind::RabbitCut { instance, .. }
            | FaultKind::RabbitWithhold { instance, .. }
            | FaultKind::RabbitBlocked { instance, .. } => Some(*instance),
            FaultKind::MongoModel { .. } | FaultKind::RabbitModel { .. } => None,
        }
    }
}

/// Shrinks a failing scenario: keeps the first smaller one that still breaks `invariant`,
/// until none does or `budget` runs were spent. `fails` runs a scenario and names the
/// invariant it broke.
pub fn shrink(
    start: &Scenario,
    invariant: &str,
    budget: usize,
    mut fails: impl FnMut(&Scenario) -> Option<String>,
) -> (Scenario, usize) {
    let mut best = start.clone();
    let mut runs = 0;
    'outer: while runs < budget {
        for candidate in best.smaller() {
            if runs >= budget {
                break 'outer;
            }
            runs += 1;
            if fails(&candidate).as_deref() == Some(invariant) {
                best = candidate;
                continue 'outer;
            }
        }
        break;
    }
    (best, runs)
}
