//! The MongoDB model held honest: the same cases against the model (`tests/sim/mongo.rs`) and
//! against the real server (SecantusDB started by the harness, or the MongoDB of
//! `TIMEOUTD_TEST_MONGODB_URI`), with the results compared.
//!
//! The cases are timeoutd's exact query surface, built by the production builders
//! (`timeoutd::store::lease`, `timeoutd::record::due`, the census and operator filters) over
//! documents from the hostile and C#-shaped generators: BSON type order, numbers equal across
//! int, long and double, GUIDs of subtypes 3 and 4, dates at the ends of the range; the
//! counts of every write the store makes; the index commands, `hello` and change streams.
//! Then each fault the model injects, against its real counterpart: `failCommand` (error
//! codes, closed connections, blocked connections that let a write land after the client gave
//! up), `maxTimeAlwaysTimeOut` (code 50) and `replSetStepDown` (10107 on writes), compared as
//! the store's error classification sees them.
//!
//! Where SecantusDB and MongoDB differ, the model follows MongoDB and the case says so (that
//! comparison is skipped on SecantusDB, with the reason).
#![allow(clippy::disallowed_methods)]
// `common` and `sim` both load the hostile generator (`sim` for the fleet); this suite uses one.
#![allow(clippy::duplicate_mod)]

mod common;
mod sim;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arbitrary::Unstructured;
use bson::spec::BinarySubtype;
use bson::{Binary, Bson, DateTime, Document, doc};
use futures::StreamExt;
use timeoutd::config::{TimeEncoding, UuidRepresentation};
use timeoutd::record::due::{self, Shape};
use timeoutd::store::backend::{AWAIT, Backend, ChangeStream, MongoError, Op, Reply};
use timeoutd::store::lease::{self, Lease};
use uuid::Uuid;

use sim::mongo::{self as model, MongoModel};

const COLL: &str = "Timeouts";
/// 2026-01-01T00:00Z: every case's "now".
const NOW_MS: i64 = 1_767_225_600_000;

fn now() -> DateTime {
    DateTime::from_millis(NOW_MS)
}

fn at(ms_from_now: i64) -> DateTime {
    DateTime::from_millis(NOW_MS + ms_from_now)
}

/// Whether the real server is the harness's SecantusDB (no `TIMEOUTD_TEST_MONGODB_URI`).
fn on_secantus() -> bool {
    std::env::var("TIMEOUTD_TEST_MONGODB_URI").map_or(true, |u| u.is_empty())
}

/// The two sides of every case, each on a database of its own.
struct Sides {
    model: MongoModel,
    real: Arc<dyn Backend>,
    client: mongodb::Client,
    db: String,
    /// The real client's `appName`, which scopes its `failCommand` failpoints.
    app: String,
}

/// Faults that reach beyond one client take this for writing (`maxTimeAlwaysTimeOut`, a
/// stepdown, and `failCommand`: the server holds one configuration of it, which each
/// `configureFailPoint` replaces, though its `appName` scopes it to the case's own client);
/// every other case for reading, so that none runs into another's fault.
static SERVER_WIDE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

impl Sides {
    async fn new() -> Self {
        let id = Uuid::new_v4().simple().to_string();
        let db = format!("conformance_{}", &id[..12]);
        let app = format!("conformance-{}", &id[..12]);
        let uri = common::with_query(&common::mongo_uri(), &format!("appName={app}"));
        let client = mongodb::Client::with_uri_str(uri).await.expect("client");
        let real = Arc::new(timeoutd::store::driver::Driver::new(client.database(&db)));
        Self {
            model: MongoModel::new(&db, 7, NOW_MS),
            real,
            client,
            db,
            app,
        }
    }

    fn sides(&self) -> [(&'static str, &dyn Backend); 2] {
        [
            ("model", &self.model as &dyn Backend),
            ("real", self.real.as_ref()),
        ]
    }

    /// Runs `op` on both sides at once (a fault's window is the same for both).
    async fn both(&self, coll: &str, op: Op) -> [Result<Reply, MongoError>; 2] {
        let (m, r) = tokio::join!(self.model.run(coll, op.clone()), self.real.run(coll, op));
        [m, r]
    }

    async fn command(&self, cmd: Document) -> [Result<Document, MongoError>; 2] {
        let m = self.model.command(cmd.clone()).await;
        let r = self.real.command(cmd).await;
        [m, r]
    }

    /// An admin command (failpoints, stepdown): the model takes it as any command. A
    /// `failCommand` failpoint is scoped to this case's client on the real server.
    async fn admin(&self, cmd: Document) -> [Result<Document, MongoError>; 2] {
        let m = self.model.command(cmd.clone()).await;
        let mut real = cmd;
        if real.get_str("configureFailPoint") == Ok("failCommand")
            && let Ok(data) = real.get_document_mut("data")
        {
            data.insert("appName", self.app.clone());
        }
        let r = self.client.database("admin").run_command(real).await;
        [m, r]
    }

    /// Inserts each document on both sides, one at a time; both must accept or refuse it
    /// alike. Returns the accepted ones.
    async fn insert_each(&self, coll: &str, docs: Vec<Document>) -> Vec<Document> {
        let mut accepted = Vec::new();
        for d in docs {
            let op = Op::Insert {
                docs: vec![d.clone()],
                ordered: true,
            };
            let [m, r] = self.both(coll, op).await;
            assert_eq!(
                classify_result(&m),
                classify_result(&r),
                "insert of {d} (model, real)"
            );
            if r.is_ok() {
                accepted.push(d);
            }
        }
        accepted
    }

    async fn cleanup(self) {
        let _ = self.client.database(&self.db).drop().await;
    }
}

/// An error as the store's classifier sees it: the kind, the code, and whether
/// `pacing::timed_out` calls it a timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Class {
    kind: &'static str,
    codes: Vec<i32>,
    timed_out: bool,
}

fn classify(e: &MongoError) -> Class {
    use mongodb::error::{ErrorKind, WriteFailure};
    let (kind, codes) = match e.kind.as_ref() {
        ErrorKind::Command(c) => ("command", vec![c.code]),
        ErrorKind::Write(WriteFailure::WriteError(w)) => ("write", vec![w.code]),
        ErrorKind::Write(_) => ("write concern", vec![]),
        ErrorKind::InsertMany(m) => (
            "insert many",
            m.write_errors.iter().flatten().map(|w| w.code).collect(),
        ),
        ErrorKind::Io(_) => ("io", vec![]),
        _ => ("other", vec![]),
    };
    Class {
        kind,
        codes,
        timed_out: timeoutd::store::pacing::timed_out(&timeoutd::store::StoreError::Mongo(
            e.clone(),
        )),
    }
}

fn classify_result<T>(r: &Result<T, MongoError>) -> Result<(), Class> {
    r.as_ref().map(|_| ()).map_err(classify)
}

fn docs_of(r: &Result<Reply, MongoError>, what: &str) -> Vec<Document> {
    match r {
        Ok(Reply::Docs(d)) => d.clone(),
        other => panic!("{what}: not documents: {other:?}"),
    }
}

/// Documents keyed by `_id` (in the model's canonical form), for comparing as sets.
fn by_id(docs: &[Document]) -> BTreeMap<String, Document> {
    docs.iter()
        .map(|d| (format!("{:?}", d.get("_id")), d.clone()))
        .collect()
}

fn ids(docs: &[Document]) -> Vec<String> {
    docs.iter().map(|d| format!("{:?}", d.get("_id"))).collect()
}

/// A reply with the documents of an unsorted find in `_id` order: MongoDB does not define the
/// order of a find without a sort (the model returns record order, SecantusDB `_id` order).
fn unordered(op: &Op, r: Result<Reply, MongoError>) -> Result<Reply, MongoError> {
    match (op, r) {
        (Op::Find { sort: None, .. }, Ok(Reply::Docs(docs))) => {
            Ok(Reply::Docs(by_id(&docs).into_values().collect()))
        }
        (_, r) => r,
    }
}

fn find(filter: Document) -> Op {
    Op::Find {
        filter,
        projection: None,
        sort: None,
        limit: None,
        max_time: Some(Duration::from_secs(10)),
    }
}

fn find_sorted(filter: Document, sort: Document, limit: Option<i64>) -> Op {
    Op::Find {
        filter,
        projection: None,
        sort: Some(sort),
        limit,
        max_time: Some(Duration::from_secs(10)),
    }
}

fn count(filter: Document) -> Op {
    Op::Count {
        filter,
        limit: None,
        max_time: Some(Duration::from_secs(10)),
    }
}

fn uuid_bson(u: Uuid) -> Bson {
    Bson::Binary(Binary {
        subtype: BinarySubtype::Uuid,
        bytes: u.as_bytes().to_vec(),
    })
}

fn seeded_uuid(seed: u64) -> Uuid {
    let bytes = common::hostile::seeded_bytes(seed, 16);
    let mut b = [0u8; 16];
    b.copy_from_slice(&bytes);
    uuid::Builder::from_random_bytes(b).into_uuid()
}

/// Every filter of timeoutd's query surface that depends on `now`, as the production builders
/// build it.
fn query_surface(now: DateTime) -> Vec<(String, Document)> {
    let shapes_sets: Vec<Vec<Shape>> = vec![
        vec![Shape::Date],
        vec![Shape::Ticks(0)],
        vec![Shape::Ticks(60)],
        vec![Shape::Ticks(-300)],
        vec![
            Shape::Date,
            Shape::Ticks(0),
            Shape::Ticks(-840),
            Shape::Ticks(840),
        ],
    ];
    let horizon = lease::add(now, Duration::from_secs(60));
    let mut out = Vec::new();
    for shapes in &shapes_sets {
        out.push((
            format!("due_filter {shapes:?}"),
            lease::due_filter(now, shapes),
        ));
        out.push((
            format!("due_within {shapes:?}"),
            lease::due_within(
                now,
                Some(DateTime::from_millis(NOW_MS - 3_600_000)),
                horizon,
                shapes,
            ),
        ));
        out.push((format!("due_by {shapes:?}"), lease::due_by(horizon, shapes)));
        out.push((
            format!("due_after {shapes:?}"),
            lease::due_after(now, shapes),
        ));
        out.push((
            format!("due_within_except {shapes:?}"),
            lease::due_within_except(now, None, now, shapes, &["q".to_string(), String::new()]),
        ));
    }
    out.push(("claimable".into(), lease::claimable(now)));
    out.push(("held_any".into(), lease::held_any(now)));
    out.push(("expired".into(), lease::expired(now)));
    out.push(("stuck".into(), lease::stuck()));
    out.push(("foreign_locks".into(), lease::foreign_locks()));
    for encoding in [
        TimeEncoding::Auto,
        TimeEncoding::Date,
        TimeEncoding::DotnetTicks,
    ] {
        out.push((
            format!("schedulable {encoding:?}"),
            due::schedulable(encoding),
        ));
        out.push((
            format!("unschedulable {encoding:?}"),
            doc! { "$nor": [due::schedulable(encoding)] },
        ));
    }
    out.push((
        "odd_locked".into(),
        timeoutd::store::census::odd_locked_filter(),
    ));
    out.push((
        "any date".into(),
        timeoutd::store::shapes::any_date_filter(),
    ));
    out.push((
        "new offsets probe".into(),
        doc! { "Time.1": { "$in": (-840..=840).filter(|o| o % 60 != 0).collect::<Vec<i32>>() } },
    ));
    out.push((
        "destination and correlation".into(),
        doc! { "$and": timeoutd::store::listing::field_clauses(Some("q"), Some(seeded_uuid(1))) },
    ));
    out
}

async fn compare_queries(s: &Sides, coll: &str, now: DateTime, tag: &str) {
    for (name, filter) in query_surface(now) {
        let [m, r] = s.both(coll, find(filter.clone())).await;
        let (m, r) = (docs_of(&m, &name), docs_of(&r, &name));
        assert_eq!(
            by_id(&m).keys().collect::<Vec<_>>(),
            by_id(&r).keys().collect::<Vec<_>>(),
            "{tag}: {name}: {filter} matched different documents (model, real)"
        );
        let [m, r] = s.both(coll, count(filter.clone())).await;
        assert_eq!(m.ok(), r.ok(), "{tag}: count of {name}");
    }
}

// ---------------------------------------------------------------------------------------------
// The query surface
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_due_and_lease_queries_match_the_same_hostile_records() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    for seed in 0..4u64 {
        let bytes = common::hostile::seeded_bytes(seed, 200_000);
        let mut u = Unstructured::new(&bytes);
        let mut docs = Vec::new();
        for i in 0..40 {
            let due = NOW_MS + (i as i64 - 20) * 30_000;
            match common::hostile::timeout_document(&mut u, due, "q", i % 3 == 0) {
                Ok(mut d) => {
                    // Some leased, some expired, some stuck, some odd.
                    match i % 5 {
                        1 => {
                            d.insert("Locked", true);
                            d.insert("LockExpiresAt", at(60_000));
                        }
                        2 => {
                            d.insert("Locked", true);
                            d.insert("LockExpiresAt", at(-60_000));
                        }
                        3 => {
                            d.insert("Locked", true);
                            d.insert("LockExpiresAt", Bson::Null);
                        }
                        4 if i % 2 == 0 => {
                            d.insert("Locked", 1);
                        }
                        _ => {}
                    }
                    docs.push(d)
                }
                Err(_) => break,
            }
        }
        let accepted = s.insert_each(COLL, docs).await;
        assert!(!accepted.is_empty(), "seed {seed}: no document accepted");
    }
    for offset in [-120_000, 0, 45_000, 600_000] {
        compare_queries(&s, COLL, at(offset), "hostile").await;
    }
    // The shape learner's two date ranges hold every date, as `$type` finds them (dates of
    // the whole BSON range among these records), on the real server.
    let ranges = s
        .both(COLL, find(timeoutd::store::shapes::any_date_filter()))
        .await;
    let typed = s
        .both(COLL, find(doc! { "Time": { "$type": "date" } }))
        .await;
    let (ranges, typed) = (docs_of(&ranges[1], "ranges"), docs_of(&typed[1], "$type"));
    assert!(!typed.is_empty(), "the hostile records hold dates");
    assert_eq!(
        by_id(&ranges).keys().collect::<Vec<_>>(),
        by_id(&typed).keys().collect::<Vec<_>>(),
        "any date: the ranges against $type"
    );
    // The claim's read: oldest first per shape, a batch at a time.
    for shape in [Shape::Date, Shape::Ticks(0)] {
        let filter = lease::due_within(now(), None, at(60_000), &[shape]);
        let op = find_sorted(filter, shape.sort(), Some(25));
        let [m, r] = s.both(COLL, op).await;
        let (m, r) = (docs_of(&m, "claim read"), docs_of(&r, "claim read"));
        assert_eq!(m.len(), r.len(), "claim read of {shape:?}: how many");
        assert_same_order(&m, &r, &shape.sort(), &format!("claim read of {shape:?}"));
    }
    // distinct("Time.1"): the shapes learn.
    let op = Op::Distinct {
        field: "Time.1".into(),
        filter: Document::new(),
        max_time: Some(Duration::from_secs(10)),
    };
    let [m, r] = s.both(COLL, op).await;
    let sorted = |r: Result<Reply, MongoError>| match r {
        Ok(Reply::Values(mut v)) => {
            v.sort_by(model::compare);
            v
        }
        other => panic!("distinct: {other:?}"),
    };
    let (m, r) = (sorted(m), sorted(r));
    assert_eq!(m.len(), r.len(), "distinct Time.1: {m:?} vs {r:?}");
    for (a, b) in m.iter().zip(&r) {
        assert!(model::equal(a, b), "distinct Time.1: {a} vs {b}");
    }
    s.cleanup().await;
}

/// The same documents in the same order where their sort keys differ; among equal keys the
/// order is the server's own (MongoDB does not define it).
fn assert_same_order(m: &[Document], r: &[Document], sort: &Document, what: &str) {
    assert_eq!(
        by_id(m).keys().collect::<Vec<_>>(),
        by_id(r).keys().collect::<Vec<_>>(),
        "{what}: different documents"
    );
    // The real order must be sorted under the model's comparison, and vice versa.
    for (side, docs) in [("model", m), ("real", r)] {
        for pair in docs.windows(2) {
            if let [a, b] = pair {
                let mut two = vec![b.clone(), a.clone()];
                model::sort_for_test(&mut two, sort);
                // Sorting [b, a] stably must put a first unless their keys tie.
                let tie = model::sort_keys_equal(a, b, sort);
                assert!(
                    tie || two.first() == Some(a),
                    "{what}: the {side} side put {:?} before {:?}, which the model's order disagrees with",
                    a.get("Time"),
                    b.get("Time")
                );
            }
        }
    }
}

#[tokio::test]
async fn bson_type_order_decides_comparisons_and_sorts() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let values: Vec<Bson> = vec![
        Bson::MinKey,
        Bson::Null,
        Bson::Int32(5),
        Bson::Double(-1.5),
        Bson::Int64(639_028_224_000_000_000),
        Bson::String("2026-01-01".into()),
        Bson::Document(doc! { "0": 639_028_224_000_000_000_i64 }),
        Bson::Array(vec![]),
        Bson::Array(vec![Bson::Int64(639_028_224_000_000_000), Bson::Int32(0)]),
        Bson::Array(vec![Bson::String("x".into()), Bson::DateTime(at(-1))]),
        Bson::Binary(Binary {
            subtype: BinarySubtype::Generic,
            bytes: vec![1, 2],
        }),
        uuid_bson(seeded_uuid(3)),
        Bson::ObjectId(bson::oid::ObjectId::from_bytes([7; 12])),
        Bson::Boolean(false),
        Bson::Boolean(true),
        Bson::DateTime(at(-1)),
        Bson::DateTime(at(1)),
        Bson::Timestamp(bson::Timestamp {
            time: 5,
            increment: 1,
        }),
        Bson::MaxKey,
    ];
    let docs: Vec<Document> = values
        .iter()
        .enumerate()
        .map(|(i, v)| doc! { "_id": i as i32, "Time": v.clone(), "Locked": false })
        .collect();
    let mut docs = docs;
    docs.push(doc! { "_id": 100, "Locked": false });
    s.insert_each(COLL, docs).await;
    compare_queries(&s, COLL, now(), "type order").await;
    for sort in [
        doc! { "Time": 1 },
        doc! { "Time": -1 },
        doc! { "Time.0": 1 },
        doc! { "Time.1": 1, "Time.0": 1 },
    ] {
        let [m, r] = s
            .both(COLL, find_sorted(Document::new(), sort.clone(), None))
            .await;
        let (m, r) = (docs_of(&m, "sort"), docs_of(&r, "sort"));
        assert_same_order(&m, &r, &sort, &format!("sort {sort}"));
    }
    s.cleanup().await;
}

/// MongoDB sorts binary values by length, then subtype, then bytes (its documented order), so
/// GUIDs of subtype 3 sort before those of subtype 4. SecantusDB orders them by their bytes
/// regardless of subtype. The model follows MongoDB; on SecantusDB the order is not compared.
#[tokio::test]
async fn binary_values_sort_by_length_then_subtype_then_bytes() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let docs: Vec<Document> = (0..6u64)
        .map(|i| {
            let u = seeded_uuid(1000 + i);
            let id = if i % 2 == 0 {
                uuid_bson(u)
            } else {
                timeoutd::record::guid::to_bson(u, UuidRepresentation::CsharpLegacy)
            };
            doc! { "_id": id, "Locked": false }
        })
        .collect();
    s.insert_each(COLL, docs).await;
    let [m, r] = s
        .both(COLL, find_sorted(Document::new(), doc! { "_id": 1 }, None))
        .await;
    let (m, r) = (docs_of(&m, "sort by _id"), docs_of(&r, "sort by _id"));
    let subtypes = |docs: &[Document]| -> Vec<u8> {
        docs.iter()
            .filter_map(|d| match d.get("_id") {
                Some(Bson::Binary(b)) => Some(u8::from(b.subtype)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        subtypes(&m),
        vec![3, 3, 3, 4, 4, 4],
        "the model sorts subtype 3 first, as MongoDB does"
    );
    if on_secantus() {
        assert_eq!(
            by_id(&m).keys().collect::<Vec<_>>(),
            by_id(&r).keys().collect::<Vec<_>>()
        );
    } else {
        assert_eq!(ids(&m), ids(&r), "binary order");
    }
    s.cleanup().await;
}

#[tokio::test]
async fn numbers_are_equal_across_int_long_and_double() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    // Ticks a double holds exactly, so each form is the same number.
    let t = |ms: i64| -> i64 {
        let ticks = ms * 10_000 + 621_355_968_000_000_000;
        (ticks as f64) as i64
    };
    let zero_decimal = {
        let x: u128 = 6176u128 << 113;
        bson::Decimal128::from_bytes(x.to_le_bytes())
    };
    let forms: Vec<(Bson, Bson)> = vec![
        (Bson::Int64(t(NOW_MS - 1000)), Bson::Int32(0)),
        (Bson::Int64(t(NOW_MS - 1000)), Bson::Int64(0)),
        (Bson::Double(t(NOW_MS - 1000) as f64), Bson::Double(0.0)),
        (Bson::Double(t(NOW_MS - 1000) as f64), Bson::Double(-0.0)),
        (
            Bson::Int64(t(NOW_MS + 1000)),
            Bson::Decimal128(zero_decimal),
        ),
        (Bson::Double(t(NOW_MS + 1000) as f64 + 0.5), Bson::Int32(0)),
        (Bson::Int32(5), Bson::Int32(0)),
        (Bson::Double(f64::NAN), Bson::Int32(0)),
        (Bson::Int64(t(NOW_MS)), Bson::Double(60.0)),
        (Bson::Int64(t(NOW_MS)), Bson::Int64(-300)),
    ];
    let mut docs = Vec::new();
    for (i, (ticks, offset)) in forms.iter().enumerate() {
        docs.push(doc! {
            "_id": uuid_bson(seeded_uuid(100 + i as u64)),
            "Destination": "q",
            "Time": [ticks.clone(), offset.clone()],
            "Locked": if i % 4 == 3 { Bson::Int32(0) } else { Bson::Boolean(false) },
            "LockedBy": uuid_bson(Uuid::nil()),
            "LockExpiresAt": Bson::Null,
        });
    }
    let docs = s.insert_each(COLL, docs).await;
    compare_queries(&s, COLL, now(), "numbers").await;
    // The claim's compare-and-swap over every numeric form: `_id`s as read, `Time` by range.
    let candidates: Vec<Bson> = docs
        .iter()
        .map(|d| d.get("_id").cloned().unwrap_or(Bson::Null))
        .collect();
    let filter = lease::claim_filter(
        now(),
        at(5_000),
        &[Shape::Ticks(0), Shape::Ticks(60)],
        &candidates,
    );
    let [m, r] = s.both(COLL, find(filter.clone())).await;
    assert_eq!(
        by_id(&docs_of(&m, "claim filter"))
            .keys()
            .collect::<Vec<_>>(),
        by_id(&docs_of(&r, "claim filter"))
            .keys()
            .collect::<Vec<_>>(),
        "claim filter {filter}"
    );
    s.cleanup().await;
}

#[tokio::test]
async fn guids_of_subtypes_3_and_4_match_their_own_form_and_the_guards_match_both() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let mut docs = Vec::new();
    for i in 0..6u64 {
        let (id, pm) = (seeded_uuid(200 + i), seeded_uuid(1));
        let mut d = if i % 2 == 0 {
            common::csharp::public_record(id, "q", pm, at(-1000 * i as i64))
        } else {
            common::v7_record(id, "q", pm, at(-1000 * i as i64), doc! { "h": "v" })
        };
        if i == 5 {
            d = common::csharp::offset_record(id, "q", pm, at(-5000), -300);
        }
        docs.push(d);
    }
    s.insert_each(COLL, docs).await;
    compare_queries(&s, COLL, now(), "guids").await;
    // Selecting by id in both forms, as cancel and reschedule do.
    for i in 0..6u64 {
        let forms = timeoutd::record::guid::both_forms(seeded_uuid(200 + i)).to_vec();
        let [m, r] = s.both(COLL, count(doc! { "_id": { "$in": forms } })).await;
        let (m, r) = (m.ok(), r.ok());
        assert_eq!(m, r, "id {i} in both forms");
        assert_eq!(r, Some(Reply::Count(1)), "id {i} found once");
    }
    // A lease written in either representation is matched by the owner guard.
    for (i, uuids) in [
        UuidRepresentation::Standard,
        UuidRepresentation::CsharpLegacy,
    ]
    .into_iter()
    .enumerate()
    {
        let lease = Lease {
            owner: seeded_uuid(300 + i as u64),
            expires_at: at(30_000),
        };
        let target = timeoutd::record::guid::both_forms(seeded_uuid(200 + i as u64)).to_vec();
        let op = Op::Update {
            filter: lease::all_of([
                doc! { "_id": { "$in": target.clone() } },
                lease::claimable(now()),
            ]),
            update: lease::claim_update(&lease, uuids),
            many: true,
            upsert: false,
        };
        let [m, r] = s.both(COLL, op).await;
        assert_eq!(m.ok(), r.ok(), "claim in {uuids:?}");
        let [m, r] = s.both(COLL, count(lease::held(lease.owner, now()))).await;
        let (m, r) = (m.ok(), r.ok());
        assert_eq!(m, r, "guard in {uuids:?}");
        assert_eq!(r, Some(Reply::Count(1)), "guard in {uuids:?} holds one");
    }
    s.cleanup().await;
}

#[tokio::test]
async fn dates_at_the_ends_of_the_range() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let ends = [
        i64::MIN,
        due::MIN_DATE_MS - 1,
        due::MIN_DATE_MS,
        -1,
        0,
        NOW_MS,
        due::MAX_DATE_MS,
        due::MAX_DATE_MS + 1,
        i64::MAX,
    ];
    let docs: Vec<Document> = ends
        .iter()
        .enumerate()
        .map(|(i, ms)| {
            let mut d = common::csharp::public_record(
                seeded_uuid(400 + i as u64),
                "q",
                seeded_uuid(1),
                DateTime::from_millis(*ms),
            );
            d.insert("Time", DateTime::from_millis(*ms));
            d
        })
        .collect();
    s.insert_each(COLL, docs).await;
    for t in [due::MIN_DATE_MS, 0, NOW_MS, due::MAX_DATE_MS] {
        compare_queries(&s, COLL, DateTime::from_millis(t), "dates").await;
    }
    for sort in [doc! { "Time": 1 }, doc! { "Time": -1 }] {
        let [m, r] = s
            .both(COLL, find_sorted(Document::new(), sort.clone(), None))
            .await;
        assert_eq!(
            ids(&docs_of(&m, "sort")),
            ids(&docs_of(&r, "sort")),
            "dates sorted by {sort}"
        );
    }
    s.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Writes
// ---------------------------------------------------------------------------------------------

async fn assert_same_contents(s: &Sides, coll: &str, what: &str) {
    let [m, r] = s.both(coll, find(Document::new())).await;
    let (m, r) = (by_id(&docs_of(&m, what)), by_id(&docs_of(&r, what)));
    assert_eq!(
        m.keys().collect::<Vec<_>>(),
        r.keys().collect::<Vec<_>>(),
        "{what}: ids"
    );
    for (k, md) in &m {
        let rd = &r[k];
        assert_eq!(md, rd, "{what}: document {k} differs (model, real)");
    }
}

#[tokio::test]
async fn every_write_the_store_makes_counts_alike() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let ids: Vec<Uuid> = (0..8).map(|i| seeded_uuid(500 + i)).collect();
    let mut docs: Vec<Document> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            common::v7_record(
                *id,
                "q",
                seeded_uuid(1),
                at(-10_000 + i as i64 * 1000),
                doc! {},
            )
        })
        .collect();
    // Two public-release records left locked by their own poller (no lease fields).
    for i in 0..2u64 {
        let mut d =
            common::csharp::public_record(seeded_uuid(600 + i), "q", seeded_uuid(1), at(-20_000));
        d.insert("Locked", true);
        docs.push(d);
    }
    s.insert_each(COLL, docs.clone()).await;
    let sides = &s;
    let step = |name: &'static str, op: Op| async move {
        let [m, r] = sides.both(COLL, op.clone()).await;
        assert_eq!(
            unordered(&op, m).map_err(|e| classify(&e)),
            unordered(&op, r.clone()).map_err(|e| classify(&e)),
            "{name}: {op:?}"
        );
        r.ok()
    };
    // Claim: candidates read, then the compare-and-swap.
    let shapes = [Shape::Ticks(0)];
    let read = step(
        "claim read",
        find_sorted(
            lease::due_within(now(), None, now(), &shapes),
            Shape::Ticks(0).sort(),
            Some(5),
        ),
    )
    .await;
    let read = match read {
        Some(Reply::Docs(d)) => d,
        other => panic!("{other:?}"),
    };
    let candidates: Vec<Bson> = read
        .iter()
        .map(|d| d.get("_id").cloned().unwrap_or(Bson::Null))
        .collect();
    let lease = Lease {
        owner: seeded_uuid(700),
        expires_at: at(30_000),
    };
    let claim = Op::Update {
        filter: lease::claim_filter(now(), now(), &shapes, &candidates),
        update: lease::claim_update(&lease, UuidRepresentation::Standard),
        many: true,
        upsert: false,
    };
    step("claim", claim.clone()).await;
    step("claim again takes nothing", claim).await;
    let held: Vec<Bson> = candidates.clone();
    step(
        "read back",
        find(lease::held_many(&held, lease.owner, now())),
    )
    .await;
    let first = held.first().cloned().unwrap_or(Bson::Null);
    step(
        "defer",
        Op::Update {
            filter: lease::held_one(&first, lease.owner, now()),
            update: lease::defer_update(at(20_000)),
            many: false,
            upsert: false,
        },
    )
    .await;
    step(
        "defer again is a no-op",
        Op::Update {
            filter: lease::held_one(&first, lease.owner, now()),
            update: lease::defer_update(at(20_000)),
            many: false,
            upsert: false,
        },
    )
    .await;
    step(
        "release some",
        Op::Update {
            filter: lease::held_many(&held[..2], lease.owner, now()),
            update: lease::release_update(UuidRepresentation::Standard),
            many: true,
            upsert: false,
        },
    )
    .await;
    step(
        "remove the rest",
        Op::Delete {
            filter: lease::held_many(&held, lease.owner, now()),
            many: true,
        },
    )
    .await;
    step(
        "remove a lost lease",
        Op::Delete {
            filter: lease::held_one(&first, lease.owner, now()),
            many: false,
        },
    )
    .await;
    // The reaper and the stuck-lock free.
    step(
        "reap",
        Op::Update {
            filter: lease::expired(at(60_000)),
            update: lease::release_update(UuidRepresentation::Standard),
            many: true,
            upsert: false,
        },
    )
    .await;
    let stuck: Vec<Bson> = (0..2u64)
        .map(|i| {
            timeoutd::record::guid::to_bson(seeded_uuid(600 + i), UuidRepresentation::CsharpLegacy)
        })
        .collect();
    step(
        "free stuck",
        Op::Update {
            filter: lease::stuck_among(&stuck),
            update: doc! { "$set": { "Locked": false } },
            many: true,
            upsert: false,
        },
    )
    .await;
    // Cancel and reschedule, guarded by the claim's own rule.
    let some: Vec<Bson> = ids[5..7].iter().map(|u| uuid_bson(*u)).collect();
    step(
        "cancel",
        Op::Delete {
            filter: lease::all_of([
                doc! { "_id": { "$in": some.clone() } },
                lease::claimable(now()),
            ]),
            many: true,
        },
    )
    .await;
    let last = uuid_bson(ids[7]);
    let old = docs[7].get("Time").cloned().unwrap_or(Bson::Null);
    step(
        "reschedule",
        Op::Update {
            filter: lease::all_of([
                doc! { "_id": last.clone(), "Time": old },
                lease::claimable(now()),
            ]),
            update: doc! { "$set": { "Time": due::encode(at(90_000), TimeEncoding::DotnetTicks) } },
            many: false,
            upsert: false,
        },
    )
    .await;
    assert_same_contents(&s, COLL, "Timeouts after the writes").await;
    // Failed-send counts: findAndModify with upsert, returning the new document.
    for n in 0..2 {
        let count_failure = Op::FindOneAndUpdate {
            filter: doc! { "_id": last.clone() },
            update: doc! {
                "$inc": { "attempts": 1 },
                "$set": { "last_error": format!("refused {n}"), "last_failed_at": now(), "expire_at": at(7 * 86_400_000) },
                "$setOnInsert": { "first_failed_at": now() },
            },
            sort: None,
            upsert: true,
            return_new: true,
            max_time: Some(Duration::from_secs(10)),
        };
        step("count a failure", count_failure).await;
    }
    assert_same_contents(&s, "Timeouts_attempts", "attempts").await;
    // Parking: a replacement upsert, twice.
    for n in 0..2 {
        let parked = doc! { "_id": last.clone(), "record": lease::as_free(docs[7].clone()), "reason": "unroutable", "error": "no route", "attempts": 3_i64, "parked_at": now(), "park_id": uuid_bson(seeded_uuid(800 + n)) };
        step(
            "park",
            Op::Replace {
                filter: doc! { "_id": last.clone() },
                replacement: parked,
                upsert: true,
            },
        )
        .await;
    }
    assert_same_contents(&s, "Timeouts_parked", "parked").await;
    // A requeue of a record still there: duplicate key.
    step(
        "requeue a duplicate",
        Op::Insert {
            docs: vec![docs[7].clone()],
            ordered: true,
        },
    )
    .await;
    let fresh = common::v7_record(seeded_uuid(900), "q", seeded_uuid(1), now(), doc! {});
    step(
        "insert many, ordered, a duplicate in the middle",
        Op::Insert {
            docs: vec![
                fresh,
                docs[7].clone(),
                common::v7_record(seeded_uuid(901), "q", seeded_uuid(1), now(), doc! {}),
            ],
            ordered: true,
        },
    )
    .await;
    step(
        "insert many, unordered",
        Op::Insert {
            docs: vec![
                docs[7].clone(),
                common::v7_record(seeded_uuid(902), "q", seeded_uuid(1), now(), doc! {}),
            ],
            ordered: false,
        },
    )
    .await;
    assert_same_contents(&s, COLL, "Timeouts after the inserts").await;
    // Counts with a limit, projections.
    step(
        "count with a limit",
        Op::Count {
            filter: Document::new(),
            limit: Some(3),
            max_time: None,
        },
    )
    .await;
    // (Unsorted: SecantusDB orders binary `_id`s unlike MongoDB, see
    // `binary_values_sort_by_length_then_subtype_then_bytes`.)
    step(
        "projection",
        Op::Find {
            filter: lease::stuck(),
            projection: Some(doc! { "_id": 1, "Time": 1, "Destination": 1 }),
            sort: None,
            limit: Some(10),
            max_time: None,
        },
    )
    .await;
    step(
        "id projection",
        Op::Find {
            filter: Document::new(),
            projection: Some(doc! { "_id": 1 }),
            sort: None,
            limit: None,
            max_time: None,
        },
    )
    .await;
    step(
        "exclusion projection",
        Op::Find {
            filter: Document::new(),
            projection: Some(doc! { "Headers": 0, "_id": 0 }),
            sort: Some(doc! { "Destination": 1, "Time": 1 }),
            limit: Some(1),
            max_time: None,
        },
    )
    .await;
    step(
        "a bad operator",
        find(doc! { "Time": { "$lte": 1, "$bogus": 2 } }),
    )
    .await;
    step("an empty $or", find(doc! { "$or": [] })).await;
    step(
        "an update without operators",
        Op::Update {
            filter: Document::new(),
            update: doc! { "Locked": true },
            many: true,
            upsert: false,
        },
    )
    .await;
    step(
        "a conflicting update",
        Op::Update {
            filter: Document::new(),
            update: doc! { "$set": { "a": 1 }, "$inc": { "a": 1 } },
            many: true,
            upsert: false,
        },
    )
    .await;
    step(
        "$inc on a string",
        Op::Update {
            filter: doc! { "_id": last.clone() },
            update: doc! { "$inc": { "Destination": 1 } },
            many: false,
            upsert: false,
        },
    )
    .await;
    s.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Commands and change streams
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn index_commands_and_hello_answer_alike() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let [m, r] = s.command(doc! { "listIndexes": COLL }).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "listIndexes of a missing collection"
    );
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    let create = |name: &str, key: Document| doc! { "createIndexes": COLL, "indexes": [{ "key": key, "name": name }] };
    for cmd in [
        create("timeoutd_due_offset", doc! { "Time.1": 1, "Time.0": 1 }),
        create("timeoutd_lease", doc! { "Locked": 1, "LockExpiresAt": 1 }),
        create("timeoutd_due_offset", doc! { "Time.1": 1, "Time.0": 1 }),
        create("timeoutd_due_offset", doc! { "Time": 1 }),
        create("other_name", doc! { "Locked": 1, "LockExpiresAt": 1 }),
        doc! { "createIndexes": COLL, "indexes": [{ "key": { "at": 1 }, "name": "ttl", "expireAfterSeconds": 60 }] },
    ] {
        let [m, r] = s.command(cmd.clone()).await;
        assert_eq!(classify_result(&m), classify_result(&r), "{cmd}");
    }
    let listed = |r: Result<Document, MongoError>| -> Vec<(String, Document, Option<Bson>)> {
        let reply = r.expect("listIndexes");
        let batch = reply
            .get_document("cursor")
            .and_then(|c| c.get_array("firstBatch"))
            .expect("firstBatch")
            .clone();
        let mut out: Vec<_> = batch
            .iter()
            .filter_map(Bson::as_document)
            .map(|d| {
                (
                    d.get_str("name").unwrap_or("").to_string(),
                    d.get_document("key").cloned().unwrap_or_default(),
                    d.get("expireAfterSeconds").cloned(),
                )
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    };
    let [m, r] = s.command(doc! { "listIndexes": COLL }).await;
    assert_eq!(listed(m), listed(r), "listIndexes");
    let [m, r] = s
        .command(doc! { "collMod": COLL, "index": { "name": "ttl", "expireAfterSeconds": 120 } })
        .await;
    assert_eq!(classify_result(&m), classify_result(&r), "collMod");
    let [m, r] = s.command(doc! { "listIndexes": COLL }).await;
    assert_eq!(listed(m), listed(r), "listIndexes after collMod");
    for cmd in [
        doc! { "dropIndexes": COLL, "index": "timeoutd_lease" },
        doc! { "dropIndexes": COLL, "index": "timeoutd_lease" },
        doc! { "collMod": COLL, "index": { "name": "nope", "expireAfterSeconds": 5 } },
    ] {
        let [m, r] = s.command(cmd.clone()).await;
        assert_eq!(classify_result(&m), classify_result(&r), "{cmd}");
    }
    let [m, r] = s.command(doc! { "listIndexes": COLL }).await;
    assert_eq!(listed(m), listed(r), "listIndexes after dropIndexes");
    for cmd in [
        doc! { "hello": 1, "maxTimeMS": 1000_i64 },
        doc! { "buildInfo": 1 },
    ] {
        let [m, r] = s.command(cmd.clone()).await;
        let (m, r) = (m.expect("model"), r.expect("real"));
        for key in ["localTime", "isWritablePrimary", "version"] {
            assert_eq!(
                m.get(key).map(Bson::element_type),
                r.get(key).map(Bson::element_type),
                "{cmd}: {key}"
            );
        }
    }
    s.cleanup().await;
}

#[tokio::test]
async fn change_streams_carry_inserts_with_their_documents() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    let pipeline = vec![doc! { "$match": { "operationType": "insert" } }];
    for (side, backend) in s.sides() {
        let mut stream = backend.watch(COLL, pipeline.clone()).await.expect("watch");
        let first = common::v7_record(seeded_uuid(10), "q", seeded_uuid(2), now(), doc! {});
        let second = common::v7_record(seeded_uuid(11), "q", seeded_uuid(2), now(), doc! {});
        backend
            .run(
                COLL,
                Op::Insert {
                    docs: vec![first.clone()],
                    ordered: true,
                },
            )
            .await
            .expect("insert");
        backend
            .run(
                COLL,
                Op::Delete {
                    filter: doc! { "_id": first.get("_id").cloned().unwrap_or(Bson::Null) },
                    many: false,
                },
            )
            .await
            .expect("delete");
        backend
            .run(
                COLL,
                Op::Insert {
                    docs: vec![second.clone()],
                    ordered: true,
                },
            )
            .await
            .expect("insert");
        for expected in [first, second] {
            let event = next_event(&mut stream, side).await;
            assert_eq!(
                event.get_str("operationType"),
                Ok("insert"),
                "{side}: {event}"
            );
            assert_eq!(
                event.get_document("fullDocument").ok(),
                Some(&expected),
                "{side}: fullDocument"
            );
            assert_eq!(
                event
                    .get_document("documentKey")
                    .ok()
                    .and_then(|k| k.get("_id")),
                expected.get("_id"),
                "{side}: documentKey"
            );
        }
    }
    s.cleanup().await;
}

/// The next change event of `stream`, past any answers with nothing new.
async fn next_event(stream: &mut ChangeStream, side: &str) -> Document {
    let event = async {
        loop {
            match stream.next().await {
                Some(Ok(Some(event))) => return event,
                Some(Ok(None)) => {}
                other => panic!("{side}: the stream failed or ended: {other:?}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), event)
        .await
        .unwrap_or_else(|_| panic!("{side}: no change event within 30 s"))
}

/// A change stream with nothing new answers each read within `AWAIT` all the same, with
/// nothing: its follower tells a quiet stream from one whose reads go unanswered by that.
#[tokio::test]
async fn a_quiet_change_stream_answers_each_read_within_the_await() {
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let pipeline = vec![
        doc! { "$match": { "operationType": "insert", "fullDocument.Destination": "nobody" } },
    ];
    for (side, backend) in s.sides() {
        let mut stream = backend.watch(COLL, pipeline.clone()).await.expect("watch");
        for read in 0..3 {
            // Generous: the server's answer comes at AWAIT; the test asserts that it comes.
            let answer = tokio::time::timeout(AWAIT * 5, stream.next())
                .await
                .unwrap_or_else(|_| {
                    panic!("{side}: read {read} of a quiet stream went unanswered")
                });
            assert!(
                matches!(answer, Some(Ok(None))),
                "{side}: read {read}: {answer:?}"
            );
        }
    }
    s.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Faults and their real counterparts
// ---------------------------------------------------------------------------------------------

/// Sets a failpoint on both sides; `false` when the real server has no test commands (a
/// MongoDB started without `enableTestCommands`): the case is then skipped.
async fn fail_point(s: &Sides, cmd: Document) -> bool {
    let [m, r] = s.admin(cmd.clone()).await;
    m.unwrap_or_else(|e| panic!("model refused {cmd}: {e}"));
    match r {
        Ok(_) => true,
        Err(e) if !on_secantus() => {
            eprintln!("skipped: the real server refused {cmd}: {e}");
            false
        }
        Err(e) => {
            panic!("SecantusDB refused {cmd} (is it started with --enable-test-commands?): {e}")
        }
    }
}

#[tokio::test]
async fn fail_command_errors_and_closed_connections_classify_alike() {
    let _exclusive = SERVER_WIDE.write().await;
    let s = Sides::new().await;
    let rec = |i: u64| common::v7_record(seeded_uuid(i), "q", seeded_uuid(2), now(), doc! {});
    s.insert_each(COLL, vec![rec(1)]).await;
    let fail_once = |data: Document| doc! { "configureFailPoint": "failCommand", "mode": { "times": 1 }, "data": data };
    if !fail_point(
        &s,
        fail_once(doc! { "failCommands": ["insert"], "errorCode": 2 }),
    )
    .await
    {
        return;
    }
    // Not retryable: the caller sees the server's error.
    let [m, r] = s
        .both(
            COLL,
            Op::Insert {
                docs: vec![rec(2)],
                ordered: true,
            },
        )
        .await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "failCommand errorCode 2"
    );
    assert_eq!(classify_result(&r).err().map(|c| c.codes), Some(vec![2]));
    // Retryable (ShutdownInProgress): the driver tries once more, and the insert succeeds.
    fail_point(
        &s,
        fail_once(doc! { "failCommands": ["insert"], "errorCode": 91 }),
    )
    .await;
    let [m, r] = s
        .both(
            COLL,
            Op::Insert {
                docs: vec![rec(3)],
                ordered: true,
            },
        )
        .await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "failCommand errorCode 91, retried"
    );
    assert!(r.is_ok());
    let attempts = s
        .model
        .log()
        .iter()
        .filter(|e| matches!(&e.event, model::LogEvent::Received { name, .. } if name == "insert"))
        .count();
    assert!(
        attempts >= 3,
        "the model's driver retried the insert ({attempts} inserts received)"
    );
    // A connection closed once under a read: retried; closed twice: the caller sees it.
    fail_point(
        &s,
        fail_once(doc! { "failCommands": ["find"], "closeConnection": true }),
    )
    .await;
    let [m, r] = s.both(COLL, find(Document::new())).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "failCommand closeConnection once"
    );
    fail_point(&s, doc! { "configureFailPoint": "failCommand", "mode": { "times": 2 }, "data": { "failCommands": ["find"], "closeConnection": true } }).await;
    let [m, r] = s.both(COLL, find(Document::new())).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "failCommand closeConnection twice"
    );
    assert_eq!(classify_result(&r).err().map(|c| c.kind), Some("io"));
    // A multi-document write is never retried.
    fail_point(
        &s,
        fail_once(doc! { "failCommands": ["update"], "errorCode": 91 }),
    )
    .await;
    let op = Op::Update {
        filter: lease::claimable(now()),
        update: doc! { "$set": { "Locked": false } },
        many: true,
        upsert: false,
    };
    let [m, r] = s.both(COLL, op).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "updateMany under errorCode 91"
    );
    assert_eq!(classify_result(&r).err().map(|c| c.codes), Some(vec![91]));
    assert_same_contents(&s, COLL, "after the failed commands").await;
    s.cleanup().await;
}

/// A write concern error's code and whether it carries `RetryableWriteError`; `None` for any
/// other outcome.
fn write_concern_of<T>(r: &Result<T, MongoError>) -> Option<(i32, bool)> {
    use mongodb::error::{ErrorKind, WriteFailure};
    match r.as_ref().err()?.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => Some((
            w.code,
            r.as_ref().err()?.contains_label("RetryableWriteError"),
        )),
        _ => None,
    }
}

/// A write that takes effect and still answers a `writeConcernError` (`failCommand` with
/// `writeConcernError`, as a replica set answers once the write was applied on the primary but
/// its write concern failed). The caller sees `Write(WriteConcernError)` where the driver does
/// not retry (a multi-document write, or a code without `RetryableWriteError`), and the write
/// is there; a retryable write labelled `RetryableWriteError` is retried and answered with the
/// first run's result, applied once.
#[tokio::test]
async fn a_write_concern_error_comes_after_the_write_took_effect() {
    let _exclusive = SERVER_WIDE.write().await;
    let s = Sides::new().await;
    let coll = "wce";
    s.insert_each(
        coll,
        (1..=4)
            .map(|i| doc! { "_id": i, "n": 0, "Locked": false })
            .collect(),
    )
    .await;
    let wtimeout = doc! {
        "code": 64,
        "codeName": "WriteConcernFailed",
        "errmsg": "waiting for replication timed out",
        "errInfo": { "wtimeout": true },
    };
    let shutdown = doc! {
        "code": 91,
        "codeName": "ShutdownInProgress",
        "errmsg": "Replication is being shut down",
    };
    let fail_once = |name: &str, wce: &Document, labels: &[&str]| {
        let mut data = doc! { "failCommands": [name], "writeConcernError": wce.clone() };
        if !labels.is_empty() {
            data.insert("errorLabels", labels.to_vec());
        }
        doc! { "configureFailPoint": "failCommand", "mode": { "times": 1 }, "data": data }
    };
    if !fail_point(&s, fail_once("update", &wtimeout, &[])).await {
        return;
    }
    // What it does, the failpoint, the write, and the write concern error the caller sees.
    type Case = (&'static str, Document, Op, Option<(i32, bool)>);
    let cases: Vec<Case> = vec![
        (
            "updateMany under a wtimeout: applied, then the error",
            fail_once("update", &wtimeout, &[]),
            Op::Update {
                filter: doc! { "Locked": false },
                update: doc! { "$set": { "Locked": true }, "$inc": { "n": 1 } },
                many: true,
                upsert: false,
            },
            Some((64, false)),
        ),
        (
            "updateMany under ShutdownInProgress: never retried",
            fail_once("update", &shutdown, &["RetryableWriteError"]),
            Op::Update {
                filter: doc! { "Locked": true },
                update: doc! { "$inc": { "n": 1 } },
                many: true,
                upsert: false,
            },
            Some((91, true)),
        ),
        (
            "updateOne under ShutdownInProgress, labelled: retried, applied once",
            fail_once("update", &shutdown, &["RetryableWriteError"]),
            Op::Update {
                filter: doc! { "_id": 1 },
                update: doc! { "$inc": { "n": 10 } },
                many: false,
                upsert: false,
            },
            None,
        ),
        (
            "findAndModify under a wtimeout: applied, then the error",
            fail_once("findAndModify", &wtimeout, &[]),
            Op::FindOneAndUpdate {
                filter: doc! { "_id": 2 },
                update: doc! { "$set": { "Locked": false } },
                sort: None,
                upsert: false,
                return_new: true,
                max_time: None,
            },
            Some((64, false)),
        ),
        (
            "deleteOne under a wtimeout: deleted, then the error",
            fail_once("delete", &wtimeout, &[]),
            Op::Delete {
                filter: doc! { "_id": 3 },
                many: false,
            },
            Some((64, false)),
        ),
        (
            "insert under ShutdownInProgress, labelled: retried, inserted once",
            fail_once("insert", &shutdown, &["RetryableWriteError"]),
            Op::Insert {
                docs: vec![doc! { "_id": 5, "n": 0, "Locked": false }],
                ordered: true,
            },
            None,
        ),
    ];
    for (what, fail, op, expected) in cases {
        fail_point(&s, fail).await;
        let [m, r] = s.both(coll, op).await;
        assert_eq!(classify_result(&m), classify_result(&r), "{what}");
        assert_eq!(write_concern_of(&m), write_concern_of(&r), "{what}");
        assert_eq!(write_concern_of(&r), expected, "{what} (real: {r:?})");
        if expected.is_none() {
            assert!(r.is_ok(), "{what}: {r:?}");
        }
        assert_same_contents(&s, coll, what).await;
    }
    s.cleanup().await;
}

/// The drawn fault: a write that took effect answers the driver's write concern error.
#[tokio::test(start_paused = true)]
async fn a_drawn_error_after_the_effect_leaves_the_write_applied() {
    let m = quiet_model();
    m.insert_direct(
        COLL,
        (1..=3)
            .map(|i| doc! { "_id": i, "Locked": false })
            .collect(),
    )
    .expect("setup");
    m.set_error_after_effect(1.0, &[64]);
    let r = m
        .run(
            COLL,
            Op::Update {
                filter: doc! {},
                update: doc! { "$set": { "Locked": true } },
                many: true,
                upsert: false,
            },
        )
        .await;
    assert_eq!(write_concern_of(&r), Some((64, false)), "{r:?}");
    assert!(
        m.snapshot(COLL)
            .iter()
            .all(|d| d.get_bool("Locked") == Ok(true)),
        "the update took effect"
    );
    // A retryable code on a single-document write: the driver retries, and the retry is
    // answered with the first run's result (applied once).
    m.set_error_after_effect(1.0, &[91]);
    let r = m
        .run(
            COLL,
            Op::Update {
                filter: doc! { "_id": 1 },
                update: doc! { "$inc": { "n": 1 } },
                many: false,
                upsert: false,
            },
        )
        .await;
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        m.get(COLL, &Bson::Int32(1))
            .and_then(|d| d.get_i32("n").ok()),
        Some(1)
    );
    // A retryable code on a multi-document write reaches the caller.
    let r = m
        .run(
            COLL,
            Op::Delete {
                filter: doc! { "Locked": true },
                many: true,
            },
        )
        .await;
    assert_eq!(write_concern_of(&r), Some((91, false)), "{r:?}");
    assert!(m.snapshot(COLL).is_empty(), "the delete took effect");
    assert_eq!(m.errors_after_effect(), 3);
}

#[tokio::test]
async fn max_time_always_times_out_with_code_50() {
    let _exclusive = SERVER_WIDE.write().await;
    let s = Sides::new().await;
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    if !fail_point(
        &s,
        doc! { "configureFailPoint": "maxTimeAlwaysTimeOut", "mode": "alwaysOn" },
    )
    .await
    {
        return;
    }
    let [m, r] = s
        .both(COLL, find(lease::due_filter(now(), &[Shape::Ticks(0)])))
        .await;
    fail_point(
        &s,
        doc! { "configureFailPoint": "maxTimeAlwaysTimeOut", "mode": "off" },
    )
    .await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "maxTimeAlwaysTimeOut"
    );
    let class = classify_result(&r).expect_err("timed out");
    assert_eq!(class.codes, vec![50]);
    assert!(
        class.timed_out,
        "the store's classifier calls code 50 a timeout"
    );
    let [m, r] = s.both(COLL, find(Document::new())).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "after the failpoint is off"
    );
    s.cleanup().await;
}

#[tokio::test]
async fn a_write_blocked_on_the_server_lands_after_the_client_gave_up() {
    let _exclusive = SERVER_WIDE.write().await;
    let s = Sides::new().await;
    let id = uuid_bson(seeded_uuid(1));
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    if !fail_point(&s, doc! { "configureFailPoint": "failCommand", "mode": { "times": 2 }, "data": { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 1500 } }).await {
        return;
    }
    for (side, backend) in s.sides() {
        let op = Op::Update {
            filter: doc! { "_id": id.clone() },
            update: doc! { "$set": { "Locked": true, "LockExpiresAt": at(5_000) } },
            many: false,
            upsert: false,
        };
        let gave_up = tokio::time::timeout(Duration::from_millis(200), backend.run(COLL, op)).await;
        assert!(
            gave_up.is_err(),
            "{side}: the blocked update answered before the client's deadline"
        );
        let landed = common::eventually(Duration::from_secs(30), || {
            let id = id.clone();
            async move {
                match backend
                    .run(COLL, count(doc! { "_id": id, "Locked": true }))
                    .await
                {
                    Ok(Reply::Count(n)) => n == 1,
                    _ => false,
                }
            }
        })
        .await;
        assert!(
            landed,
            "{side}: the write the client gave up on never landed"
        );
    }
    s.cleanup().await;
}

#[tokio::test]
async fn a_stepdown_fails_multi_document_writes_and_holds_the_others_until_a_primary_is_back() {
    let _exclusive = SERVER_WIDE.write().await;
    let s = Sides::new().await;
    let id = uuid_bson(seeded_uuid(1));
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    let stepdown = doc! { "replSetStepDown": 3, "secondaryCatchUpPeriodSecs": 1, "force": true };
    let [m, r] = s.admin(stepdown.clone()).await;
    m.expect("model stepdown");
    if let Err(e) = r {
        // A standalone MongoDB has no replication to step down (NoReplicationEnabled).
        assert!(!on_secantus(), "SecantusDB refused {stepdown}: {e}");
        eprintln!("skipped: the real server refused {stepdown}: {e}");
        return;
    }
    let [m, r] = s.command(doc! { "hello": 1 }).await;
    assert_eq!(
        m.expect("hello").get_bool("isWritablePrimary"),
        Ok(false),
        "model hello"
    );
    assert_eq!(
        r.expect("hello").get_bool("isWritablePrimary"),
        Ok(false),
        "real hello"
    );
    // The claim's updateMany: not retryable, NotWritablePrimary.
    let claim = Op::Update {
        filter: lease::claimable(now()),
        update: lease::claim_update(
            &Lease {
                owner: seeded_uuid(9),
                expires_at: at(30_000),
            },
            UuidRepresentation::Standard,
        ),
        many: true,
        upsert: false,
    };
    let [m, r] = s.both(COLL, claim).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "a claim during the stepdown"
    );
    assert_eq!(
        classify_result(&r).err().map(|c| c.codes),
        Some(vec![10107])
    );
    // A single-document write after it: the driver, which now knows there is no primary,
    // waits for one (server selection) and then writes.
    let release = Op::Update {
        filter: doc! { "_id": id.clone() },
        update: lease::release_update(UuidRepresentation::Standard),
        many: false,
        upsert: false,
    };
    let [m, r] = s.both(COLL, release).await;
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "a release during the stepdown"
    );
    assert!(r.is_ok());
    for (side, backend) in s.sides() {
        let back = common::eventually(Duration::from_secs(60), || async move {
            matches!(backend.command(doc! { "hello": 1 }).await, Ok(h) if h.get_bool("isWritablePrimary") == Ok(true))
        })
        .await;
        assert!(back, "{side}: never primary again");
    }
    assert_same_contents(&s, COLL, "after the stepdown").await;
    s.cleanup().await;
}

/// What SecantusDB does differently: its NotWritablePrimary carries no RetryableWriteError
/// label, so the driver does not retry a single-document write that met the stepdown first,
/// where MongoDB (4.4+, which labels it) has it retried once a primary is back. The model
/// follows MongoDB; on SecantusDB this case only records the difference.
#[tokio::test]
async fn a_single_document_write_that_meets_a_stepdown_first_is_retried_as_on_mongodb() {
    let _exclusive = SERVER_WIDE.write().await;
    let s = Sides::new().await;
    let id = uuid_bson(seeded_uuid(1));
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    let stepdown = doc! { "replSetStepDown": 2, "secondaryCatchUpPeriodSecs": 1, "force": true };
    let [m, r] = s.admin(stepdown.clone()).await;
    m.expect("model stepdown");
    if r.is_err() {
        eprintln!("skipped: the real server refused {stepdown}");
        return;
    }
    let write = Op::Update {
        filter: doc! { "_id": id.clone() },
        update: doc! { "$set": { "Locked": true } },
        many: false,
        upsert: false,
    };
    let [m, r] = s.both(COLL, write).await;
    assert!(
        m.is_ok(),
        "the model's driver retries once a primary is back: {m:?}"
    );
    if on_secantus() {
        let e = r.expect_err("SecantusDB: NotWritablePrimary, not retried");
        assert_eq!(classify(&e).codes, vec![10107]);
        assert!(
            !e.contains_label("RetryableWriteError"),
            "SecantusDB now labels it: compare both sides here"
        );
    } else {
        assert_eq!(
            classify_result(&m),
            classify_result(&r),
            "a write that meets the stepdown first"
        );
    }
    for (side, backend) in s.sides() {
        let back = common::eventually(Duration::from_secs(60), || async move {
            matches!(backend.command(doc! { "hello": 1 }).await, Ok(h) if h.get_bool("isWritablePrimary") == Ok(true))
        })
        .await;
        assert!(back, "{side}: never primary again");
    }
    s.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The model's own faults (no server needed): what the simulation relies on
// ---------------------------------------------------------------------------------------------

fn quiet_model() -> MongoModel {
    MongoModel::new("sim", 42, NOW_MS)
}

#[tokio::test(start_paused = true)]
async fn a_request_the_client_dropped_still_runs_and_its_write_lands_late() {
    let m = quiet_model();
    m.insert_direct(COLL, vec![doc! { "_id": 1, "Locked": false }])
        .expect("setup");
    let mut plan = model::FaultPlan::default();
    plan.by_op.insert(
        "updateOne".into(),
        model::Faults {
            latency: model::Latency::Fixed(Duration::from_secs(5)),
            ..Default::default()
        },
    );
    m.set_faults(plan);
    let op = Op::Update {
        filter: doc! { "_id": 1 },
        update: doc! { "$set": { "Locked": true } },
        many: false,
        upsert: false,
    };
    assert!(
        tokio::time::timeout(Duration::from_secs(1), m.run(COLL, op))
            .await
            .is_err()
    );
    assert_eq!(
        m.get(COLL, &Bson::Int32(1))
            .and_then(|d| d.get_bool("Locked").ok()),
        Some(false)
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        m.get(COLL, &Bson::Int32(1))
            .and_then(|d| d.get_bool("Locked").ok()),
        Some(true)
    );
    assert!(
        m.log()
            .iter()
            .any(|e| matches!(e.event, model::LogEvent::ClientGone))
    );
}

#[tokio::test(start_paused = true)]
async fn a_run_longer_than_its_max_time_fails_with_code_50_at_max_time() {
    let m = quiet_model();
    let mut plan = model::FaultPlan::default();
    plan.default.latency = model::Latency::Fixed(Duration::from_secs(3));
    m.set_faults(plan);
    let started = tokio::time::Instant::now();
    let e = m
        .run(
            COLL,
            Op::Find {
                filter: Document::new(),
                projection: None,
                sort: None,
                limit: None,
                max_time: Some(Duration::from_secs(1)),
            },
        )
        .await
        .expect_err("times out");
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(classify(&e).codes, vec![50]);
    assert!(classify(&e).timed_out);
}

#[tokio::test(start_paused = true)]
async fn a_stepdown_interrupts_a_multi_document_update_after_part_of_it() {
    let m = quiet_model();
    m.insert_direct(
        COLL,
        (0..5).map(|i| doc! { "_id": i, "Locked": false }).collect(),
    )
    .expect("setup");
    let mut plan = model::FaultPlan::default();
    plan.default.per_document = Some(model::Latency::Fixed(Duration::from_secs(1)));
    m.set_faults(plan);
    let stepper = m.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        stepper.step_down_for(Duration::from_secs(10));
    });
    let op = Op::Update {
        filter: doc! { "Locked": false },
        update: doc! { "$set": { "Locked": true } },
        many: true,
        upsert: false,
    };
    let e = m.run(COLL, op).await.expect_err("interrupted");
    assert_eq!(classify(&e).codes, vec![11602]);
    let locked = m
        .snapshot(COLL)
        .iter()
        .filter(|d| d.get_bool("Locked") == Ok(true))
        .count();
    assert_eq!(
        locked, 3,
        "the documents written before the stepdown stay written"
    );
    let hello = m.command(doc! { "hello": 1 }).await.expect("hello");
    assert_eq!(hello.get_bool("isWritablePrimary"), Ok(false));
}

#[tokio::test(start_paused = true)]
async fn a_multi_document_update_yields_between_documents() {
    let m = quiet_model();
    m.insert_direct(
        COLL,
        (0..4).map(|i| doc! { "_id": i, "Locked": false }).collect(),
    )
    .expect("setup");
    let mut plan = model::FaultPlan::default();
    plan.default.per_document = Some(model::Latency::Zero);
    m.set_faults(plan);
    let take = m.client("a").run(
        COLL,
        Op::Update {
            filter: doc! { "Locked": false },
            update: doc! { "$set": { "Locked": true, "by": "a" } },
            many: true,
            upsert: false,
        },
    );
    let other = m.client("b").run(
        COLL,
        Op::Update {
            filter: doc! { "Locked": false },
            update: doc! { "$set": { "Locked": true, "by": "b" } },
            many: true,
            upsert: false,
        },
    );
    let (a, b) = tokio::join!(take, other);
    let count = |r: Result<Reply, MongoError>| match r {
        Ok(Reply::Written(w)) => w.modified,
        other => panic!("{other:?}"),
    };
    let (a, b) = (count(a), count(b));
    assert_eq!(a + b, 4, "each document taken once");
    assert!(a > 0 && b > 0, "the two updates interleaved ({a}, {b})");
}

#[tokio::test(start_paused = true)]
async fn the_server_clock_drifts_and_steps_on_virtual_time() {
    let m = quiet_model();
    let local = |h: Document| {
        h.get_datetime("localTime")
            .map(|d| d.timestamp_millis())
            .expect("localTime")
    };
    assert_eq!(
        local(m.command(doc! { "hello": 1 }).await.expect("hello")),
        NOW_MS
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(m.server_ms(), NOW_MS + 10_000);
    m.step_clock_ms(-4_000);
    assert_eq!(m.server_ms(), NOW_MS + 6_000);
    m.set_drift_ppm(100_000);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        local(m.command(doc! { "hello": 1 }).await.expect("hello")),
        NOW_MS + 17_000
    );
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_draws_the_same_faults() {
    let outcomes = |seed: u64| async move {
        let m = MongoModel::new("sim", seed, NOW_MS);
        let plan = model::FaultPlan {
            default: model::Faults {
                p_cut: 0.3,
                p_lose_reply: 0.3,
                latency: model::Latency::Uniform(Duration::ZERO, Duration::from_millis(50)),
                ..Default::default()
            },
            ..Default::default()
        };
        m.set_faults(plan);
        let mut seen = Vec::new();
        for i in 0..30 {
            let r = m
                .run(
                    COLL,
                    Op::Insert {
                        docs: vec![doc! { "_id": i }],
                        ordered: true,
                    },
                )
                .await;
            seen.push((r.is_ok(), tokio::time::Instant::now()));
        }
        (seen, m.snapshot(COLL).len())
    };
    let (a, b) = (outcomes(9).await, outcomes(9).await);
    assert_eq!(
        a.0.iter().map(|x| x.0).collect::<Vec<_>>(),
        b.0.iter().map(|x| x.0).collect::<Vec<_>>()
    );
    assert_eq!(a.1, b.1);
    assert!(
        a.0.iter().any(|x| !x.0) && a.0.iter().any(|x| x.0),
        "some failed, some did not"
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_reply_a_cut_lost_is_retried_and_applied_once() {
    let m = quiet_model();
    m.insert_direct(COLL, vec![doc! { "_id": 1, "n": 0 }])
        .expect("setup");
    let mut plan = model::FaultPlan::default();
    plan.default.latency = model::Latency::Fixed(Duration::from_secs(2));
    m.set_faults(plan);
    let cutter = m.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        cutter.cut_for(Duration::from_secs(5));
    });
    let op = Op::Update {
        filter: doc! { "_id": 1 },
        update: doc! { "$inc": { "n": 1 } },
        many: false,
        upsert: false,
    };
    let started = tokio::time::Instant::now();
    let reply = m
        .run(COLL, op.clone())
        .await
        .expect("retried after the cut");
    assert!(
        started.elapsed() >= Duration::from_secs(6),
        "waited for the cut to end"
    );
    assert_eq!(
        reply,
        Reply::Written(timeoutd::store::backend::Written {
            matched: 1,
            modified: 1,
            ..Default::default()
        })
    );
    assert_eq!(
        m.get(COLL, &Bson::Int32(1))
            .and_then(|d| d.get_i32("n").ok()),
        Some(1),
        "applied once"
    );
    // Without the driver's retries the caller sees the lost reply.
    m.set_driver(model::DriverModel {
        retries: false,
        ..Default::default()
    });
    m.cut_for(Duration::from_millis(1500));
    let e = m.run(COLL, op).await.expect_err("reply lost");
    assert_eq!(classify(&e).kind, "io");
}

/// The test proxy's modes against the model's faults: replies held back (the write lands,
/// the client hears nothing until its own deadline) and a cut (an I/O error, and after the
/// driver's one retry finds no server, still that error).
#[tokio::test]
async fn held_replies_and_cuts_match_the_test_proxy() {
    use common::proxy::{Mode, Proxy, host_port};
    let _shared = SERVER_WIDE.read().await;
    let s = Sides::new().await;
    let id = uuid_bson(seeded_uuid(1));
    s.insert_each(
        COLL,
        vec![common::v7_record(
            seeded_uuid(1),
            "q",
            seeded_uuid(2),
            now(),
            doc! {},
        )],
    )
    .await;
    let proxy = Proxy::start(&host_port(&common::mongo_uri())).await;
    let uri = common::with_query(
        &common::with_query(
            &proxy.rewrite(&common::mongo_uri()),
            "directConnection=true",
        ),
        "serverSelectionTimeoutMS=2000",
    );
    let proxied = mongodb::Client::with_uri_str(uri).await.expect("client");
    let real = timeoutd::store::driver::Driver::new(proxied.database(&s.db));
    real.run(COLL, count(Document::new()))
        .await
        .expect("through the proxy");
    let model = s.model.client("proxied");
    model.set_driver(model::DriverModel {
        retries: true,
        server_selection: Duration::from_secs(2),
    });
    let write = Op::Update {
        filter: doc! { "_id": id.clone() },
        update: doc! { "$set": { "Locked": true } },
        many: false,
        upsert: false,
    };
    // Held replies.
    proxy.set(Mode::HoldReplies);
    let mut plan = model::FaultPlan::default();
    plan.default.reply_latency = model::Latency::Fixed(Duration::from_secs(3600));
    s.model.set_client_faults("proxied", plan);
    for (side, backend) in [("model", &model as &dyn Backend), ("real", &real)] {
        let gave_up =
            tokio::time::timeout(Duration::from_secs(1), backend.run(COLL, write.clone())).await;
        assert!(gave_up.is_err(), "{side}: answered while replies were held");
    }
    for (side, backend) in s.sides() {
        let landed = common::eventually(Duration::from_secs(30), || {
            let id = id.clone();
            async move {
                matches!(
                    backend
                        .run(COLL, count(doc! { "_id": id, "Locked": true }))
                        .await,
                    Ok(Reply::Count(1))
                )
            }
        })
        .await;
        assert!(landed, "{side}: the write never landed");
    }
    // A cut that outlasts server selection.
    proxy.set(Mode::Cut);
    s.model
        .set_client_faults("proxied", model::FaultPlan::default());
    s.model.cut_client_for("proxied", Duration::from_secs(30));
    let (m, r) = tokio::join!(
        model.run(COLL, write.clone()),
        real.run(COLL, write.clone())
    );
    assert_eq!(
        classify_result(&m),
        classify_result(&r),
        "a write through a cut"
    );
    assert_eq!(classify_result(&r).err().map(|c| c.kind), Some("io"));
    proxy.set(Mode::Forward);
    s.cleanup().await;
}
