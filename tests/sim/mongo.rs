//! An in-memory model of MongoDB behind [`timeoutd::store::backend::Backend`], for the
//! deterministic simulation. What timeoutd can tell apart, it behaves as MongoDB does (and the
//! conformance suite, `tests/conformance_mongodb.rs`, holds it to that against a real server):
//!
//! - collections of documents keyed by `_id` (record order is insertion order), a query matcher
//!   with MongoDB's semantics for what timeoutd sends (implicit and explicit `$and`, `$or`,
//!   `$nor`, comparisons with BSON type bracketing and numbers compared across int, long and
//!   double, `$in`, `$nin`, `$exists`, `$type`, `$not`, `$size`, dotted paths with positional
//!   and implicit array traversal), projection, multi-key sort in BSON order, limit; updates
//!   (`$set`, `$unset`, `$inc`, `$setOnInsert`, `$min`, `$max`, replacement, upsert) applied in
//!   MongoDB 5+'s field order; inserts with duplicate keys (11000); count, distinct; commands
//!   (`hello` with the model's server clock, `buildInfo`, index commands, `serverStatus`,
//!   `configureFailPoint`, `replSetStepDown`); change streams;
//! - each request is a task of its own on the runtime: the client's future only awaits the
//!   reply, so a client that gives up leaves the operation to run to its end (its write lands
//!   late, its reply goes nowhere);
//! - faults, per operation name and drawn from a seeded generator: latency before and after
//!   the effect, `maxTimeMS` (code 50 once the modelled run passes it), requests cut before
//!   they arrive, replies lost after the effect, command errors, stalls, windows of cut and
//!   stall per client or for all, a stepdown (hello says not primary, writes fail with 10107,
//!   a multi-document write in progress stops with 11602 having written part), multi-document
//!   writes that yield between documents; writes that take effect and still answer an error
//!   (a `writeConcernError`: wtimeout 64, or 91, 189, 11602 once the write was applied on the
//!   primary), drawn from a generator of their own ([`AfterEffect`]);
//! - an operations log (each request, each document written with its before and after, each
//!   reply delivered or lost) and direct accessors for the invariant checker.
//!
//! - what the `mongodb` driver adds above the server, which the daemon's `Driver` backend
//!   includes ([`DriverModel`], on by default): one retry of retryable writes and reads (a
//!   write retried after its reply was lost is not applied twice), and server selection that
//!   waits for a reachable primary once a client saw none. Multi-document writes and commands
//!   are never retried.
//!
//! Use: `let db = MongoModel::new("timeouts", seed, start_ms);` then one handle per instance,
//! `db.client("i1")` (an `Arc<dyn Backend>` for `Store`); faults with `set_faults` /
//! `set_client_faults` ([`FaultPlan`] of [`Faults`] per operation name), windows with
//! `cut_client_for`, `stall_client_for`, `step_down_for`, the server clock with
//! `step_clock_ms` and `set_drift_ppm`, `heal()` for the liveness phase; the checker reads
//! `log_since(seq)`, `snapshot(collection)`, `get(collection, id)`, `server_now()`. The same
//! test commands as a real server: `configureFailPoint` (`failCommand` with `errorCode`,
//! `closeConnection`, `blockConnection`, `writeConcernError` with `errorLabels`;
//! `maxTimeAlwaysTimeOut`) and `replSetStepDown`. Errors after the effect with
//! `set_error_after_effect`.
//! Not modelled: TTL expiry, unique indexes other than `_id`, `$elemMatch`, regular
//! expressions, aggregation; a request for them fails with BadValue (2) rather than be
//! answered wrong.
//!
//! No real time: every delay is a `tokio::time::sleep`, the server clock runs on
//! `tokio::time::Instant` (with drift and steps). Single-threaded use under a paused runtime is
//! the target; the state sits behind one `std::sync::Mutex`, never held across an await.
#![allow(dead_code, clippy::disallowed_methods)]

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};
use futures::future::BoxFuture;
use futures::stream::StreamExt;
use timeoutd::store::backend::{
    AWAIT, Backend, ChangeStream, MongoError, Op, Reply, Written, command_error,
};
use tokio::sync::{broadcast, oneshot};
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// BSON order
// ---------------------------------------------------------------------------------------------

/// MongoDB's canonical type class: values compare across classes by this, within by value.
pub fn type_rank(v: &Bson) -> u8 {
    match v {
        Bson::MinKey => 0,
        Bson::Undefined => 1,
        Bson::Null => 2,
        Bson::Double(_) | Bson::Int32(_) | Bson::Int64(_) | Bson::Decimal128(_) => 3,
        Bson::String(_) | Bson::Symbol(_) => 4,
        Bson::Document(_) => 5,
        Bson::Array(_) => 6,
        Bson::Binary(_) => 7,
        Bson::ObjectId(_) => 8,
        Bson::Boolean(_) => 9,
        Bson::DateTime(_) => 10,
        Bson::Timestamp(_) => 11,
        Bson::RegularExpression(_) => 12,
        Bson::DbPointer(_) => 13,
        Bson::JavaScriptCode(_) => 14,
        Bson::JavaScriptCodeWithScope(_) => 15,
        Bson::MaxKey => 16,
    }
}

#[derive(Debug, Clone, Copy)]
enum Num {
    I(i64),
    F(f64),
}

fn num(v: &Bson) -> Option<Num> {
    match v {
        Bson::Int32(i) => Some(Num::I(i64::from(*i))),
        Bson::Int64(i) => Some(Num::I(*i)),
        Bson::Double(f) => Some(Num::F(*f)),
        Bson::Decimal128(d) => Some(Num::F(decimal_to_f64(d))),
        _ => None,
    }
}

/// A Decimal128 as the nearest double (enough for the comparisons timeoutd's data needs).
pub fn decimal_to_f64(d: &bson::Decimal128) -> f64 {
    let x = u128::from_le_bytes(d.bytes());
    let negative = x >> 127 == 1;
    let combination = (x >> 122) & 0x1f;
    let (exponent, coefficient) = if (x >> 125) & 0b11 == 0b11 {
        if combination == 0b11110 {
            return if negative {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            };
        }
        if combination == 0b11111 {
            return f64::NAN;
        }
        ((x >> 111) & 0x3fff, 0u128)
    } else {
        ((x >> 113) & 0x3fff, x & ((1u128 << 113) - 1))
    };
    let coefficient = if coefficient > 9_999_999_999_999_999_999_999_999_999_999_999 {
        0
    } else {
        coefficient
    };
    let e = exponent as i64 - 6176;
    let v = format!("{coefficient}e{e}").parse::<f64>().unwrap_or(0.0);
    if negative { -v } else { v }
}

fn is_nan(v: &Bson) -> bool {
    matches!(num(v), Some(Num::F(f)) if f.is_nan())
}

fn cmp_int_float(a: i64, b: f64) -> Ordering {
    if b.is_nan() {
        return Ordering::Greater;
    }
    // 2^63: no i64 reaches it; -2^63 is i64::MIN.
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if b >= TWO_63 {
        return Ordering::Less;
    }
    if b < -TWO_63 {
        return Ordering::Greater;
    }
    let t = b.trunc();
    match a.cmp(&(t as i64)) {
        Ordering::Equal => {
            let frac = b - t;
            if frac > 0.0 {
                Ordering::Less
            } else if frac < 0.0 {
                Ordering::Greater
            } else {
                Ordering::Equal
            }
        }
        o => o,
    }
}

fn cmp_num(a: Num, b: Num) -> Ordering {
    match (a, b) {
        (Num::I(x), Num::I(y)) => x.cmp(&y),
        (Num::I(x), Num::F(y)) => cmp_int_float(x, y),
        (Num::F(x), Num::I(y)) => cmp_int_float(y, x).reverse(),
        (Num::F(x), Num::F(y)) => match (x.is_nan(), y.is_nan()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            _ => x.partial_cmp(&y).unwrap_or(Ordering::Equal),
        },
    }
}

/// MongoDB's total order on BSON values (`BSONElement::woCompare` without field names).
pub fn compare(a: &Bson, b: &Bson) -> Ordering {
    let (ra, rb) = (type_rank(a), type_rank(b));
    if ra != rb {
        return ra.cmp(&rb);
    }
    match (a, b) {
        _ if ra == 3 => match (num(a), num(b)) {
            (Some(x), Some(y)) => cmp_num(x, y),
            _ => Ordering::Equal,
        },
        (Bson::String(x) | Bson::Symbol(x), Bson::String(y) | Bson::Symbol(y)) => {
            x.as_bytes().cmp(y.as_bytes())
        }
        (Bson::Document(x), Bson::Document(y)) => compare_docs(x, y),
        (Bson::Array(x), Bson::Array(y)) => {
            for (p, q) in x.iter().zip(y.iter()) {
                let o = type_rank(p).cmp(&type_rank(q)).then_with(|| compare(p, q));
                if o != Ordering::Equal {
                    return o;
                }
            }
            x.len().cmp(&y.len())
        }
        (Bson::Binary(x), Bson::Binary(y)) => x
            .bytes
            .len()
            .cmp(&y.bytes.len())
            .then_with(|| u8::from(x.subtype).cmp(&u8::from(y.subtype)))
            .then_with(|| x.bytes.cmp(&y.bytes)),
        (Bson::ObjectId(x), Bson::ObjectId(y)) => x.bytes().cmp(&y.bytes()),
        (Bson::Boolean(x), Bson::Boolean(y)) => x.cmp(y),
        (Bson::DateTime(x), Bson::DateTime(y)) => x.timestamp_millis().cmp(&y.timestamp_millis()),
        (Bson::Timestamp(x), Bson::Timestamp(y)) => {
            (x.time, x.increment).cmp(&(y.time, y.increment))
        }
        (Bson::RegularExpression(x), Bson::RegularExpression(y)) => x
            .pattern
            .cmp(&y.pattern)
            .then_with(|| x.options.cmp(&y.options)),
        (Bson::JavaScriptCode(x), Bson::JavaScriptCode(y)) => x.cmp(y),
        (Bson::JavaScriptCodeWithScope(x), Bson::JavaScriptCodeWithScope(y)) => x
            .code
            .cmp(&y.code)
            .then_with(|| compare_docs(&x.scope, &y.scope)),
        _ => Ordering::Equal,
    }
}

/// Documents compare element by element: type class, then field name, then value.
pub fn compare_docs(x: &Document, y: &Document) -> Ordering {
    for ((ka, va), (kb, vb)) in x.iter().zip(y.iter()) {
        let o = type_rank(va)
            .cmp(&type_rank(vb))
            .then_with(|| ka.as_bytes().cmp(kb.as_bytes()))
            .then_with(|| compare(va, vb));
        if o != Ordering::Equal {
            return o;
        }
    }
    x.len().cmp(&y.len())
}

/// Equal as a query's equality sees it (numbers across types, NaN equals NaN).
pub fn equal(a: &Bson, b: &Bson) -> bool {
    compare(a, b) == Ordering::Equal
}

/// The same bytes: what decides whether an update modified a document.
fn same_bytes(a: &Document, b: &Document) -> bool {
    match (bson::to_vec(a), bson::to_vec(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// A key under which equal `_id`s collide (1, 1L and 1.0 are one `_id`).
fn id_key(v: &Bson) -> String {
    match num(v) {
        Some(Num::I(i)) => format!("n{i}"),
        Some(Num::F(f)) if f.fract() == 0.0 && f.abs() < 9.2e18 => format!("n{}", f as i64),
        Some(Num::F(f)) if f.is_nan() => "nNaN".into(),
        Some(Num::F(f)) => format!("f{f:e}"),
        None => {
            let bytes = bson::to_vec(&doc! { "": v.clone() }).unwrap_or_default();
            format!("t{}:{}", type_rank(v), hex(&bytes))
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Paths
// ---------------------------------------------------------------------------------------------

/// The values a dotted path reaches in `doc`, one per branch (`None`: missing on that branch).
/// Arrays on the way are traversed as MongoDB does: a numeric component indexes the array, and
/// every element that is a document is looked into as well. Arrays at the end are returned
/// whole; predicates look at their elements too.
pub fn path_values<'a>(doc: &'a Document, path: &str) -> Vec<Option<&'a Bson>> {
    let parts: Vec<&str> = path.split('.').collect();
    let mut out = Vec::new();
    match parts.split_first() {
        Some((first, rest)) => match doc.get(*first) {
            Some(v) => collect(v, rest, &mut out),
            None => out.push(None),
        },
        None => out.push(None),
    }
    out
}

fn collect<'a>(v: &'a Bson, parts: &[&str], out: &mut Vec<Option<&'a Bson>>) {
    let Some((first, rest)) = parts.split_first() else {
        out.push(Some(v));
        return;
    };
    match v {
        Bson::Document(d) => match d.get(*first) {
            Some(x) => collect(x, rest, out),
            None => out.push(None),
        },
        Bson::Array(items) => {
            let before = out.len();
            if !first.is_empty()
                && first.bytes().all(|b| b.is_ascii_digit())
                && let Some(x) = first.parse::<usize>().ok().and_then(|i| items.get(i))
            {
                collect(x, rest, out);
            }
            for item in items {
                if let Bson::Document(_) = item {
                    collect(item, parts, out);
                }
            }
            if out.len() == before {
                out.push(None);
            }
        }
        _ => out.push(None),
    }
}

/// The value at a dotted path through documents only (updates).
fn get_path<'a>(doc: &'a Document, path: &str) -> Option<&'a Bson> {
    let mut parts = path.split('.');
    let mut cur = doc.get(parts.next()?)?;
    for p in parts {
        cur = match cur {
            Bson::Document(d) => d.get(p)?,
            Bson::Array(a) => a.get(p.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

// ---------------------------------------------------------------------------------------------
// Queries
// ---------------------------------------------------------------------------------------------

fn bad_value(message: &str) -> MongoError {
    command_error(2, "BadValue", message)
}

/// A parsed query.
#[derive(Debug, Clone)]
pub enum Expr {
    And(Vec<Expr>),
    Or(Vec<Expr>),
    Nor(Vec<Expr>),
    Path(String, Vec<Pred>),
}

/// One predicate on the values of a path.
#[derive(Debug, Clone)]
pub enum Pred {
    Eq(Bson),
    Ne(Bson),
    Cmp(CmpOp, Bson),
    In(Vec<Bson>),
    Nin(Vec<Bson>),
    Exists(bool),
    Type(Vec<i32>),
    Not(Vec<Pred>),
    Size(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Lt,
    Lte,
    Gt,
    Gte,
}

/// Parses a filter document; errors as the server gives them (code 2, BadValue).
pub fn parse_filter(filter: &Document) -> Result<Expr, MongoError> {
    let mut clauses = Vec::new();
    for (k, v) in filter {
        match k.as_str() {
            "$and" | "$or" | "$nor" => {
                let Bson::Array(items) = v else {
                    return Err(bad_value(&format!("{k} must be an array")));
                };
                if items.is_empty() {
                    return Err(bad_value("$and/$or/$nor must be a nonempty array"));
                }
                let mut subs = Vec::new();
                for item in items {
                    let Bson::Document(d) = item else {
                        return Err(bad_value("$or/$and/$nor entries need to be full objects"));
                    };
                    subs.push(parse_filter(d)?);
                }
                clauses.push(match k.as_str() {
                    "$and" => Expr::And(subs),
                    "$or" => Expr::Or(subs),
                    _ => Expr::Nor(subs),
                });
            }
            "$comment" => {}
            other if other.starts_with('$') => {
                return Err(bad_value(&format!("unknown top level operator: {other}")));
            }
            path => clauses.push(Expr::Path(path.to_string(), parse_value(v)?)),
        }
    }
    Ok(Expr::And(clauses))
}

fn is_operator_doc(v: &Bson) -> Option<&Document> {
    match v {
        Bson::Document(d) if d.keys().next().is_some_and(|k| k.starts_with('$')) => Some(d),
        _ => None,
    }
}

fn parse_value(v: &Bson) -> Result<Vec<Pred>, MongoError> {
    if let Some(ops) = is_operator_doc(v) {
        return parse_ops(ops);
    }
    if let Bson::RegularExpression(_) = v {
        return Err(bad_value("the model does not match regular expressions"));
    }
    Ok(vec![Pred::Eq(v.clone())])
}

fn truthy(v: &Bson) -> bool {
    match v {
        Bson::Boolean(b) => *b,
        Bson::Null | Bson::Undefined => false,
        other => match num(other) {
            Some(Num::I(i)) => i != 0,
            Some(Num::F(f)) => f != 0.0,
            None => true,
        },
    }
}

fn type_code(alias: &Bson) -> Result<Vec<i32>, MongoError> {
    let named = |s: &str| -> Option<Vec<i32>> {
        Some(vec![match s {
            "double" => 1,
            "string" => 2,
            "object" => 3,
            "array" => 4,
            "binData" => 5,
            "undefined" => 6,
            "objectId" => 7,
            "bool" => 8,
            "date" => 9,
            "null" => 10,
            "regex" => 11,
            "dbPointer" => 12,
            "javascript" => 13,
            "symbol" => 14,
            "javascriptWithScope" => 15,
            "int" => 16,
            "timestamp" => 17,
            "long" => 18,
            "decimal" => 19,
            "minKey" => -1,
            "maxKey" => 127,
            "number" => return Some(vec![1, 16, 18, 19]),
            _ => return None,
        }])
    };
    match alias {
        Bson::String(s) => {
            named(s).ok_or_else(|| bad_value(&format!("Unknown type name alias: {s}")))
        }
        other => match num(other) {
            Some(Num::I(i)) if [-1, 127].contains(&i) || (1..=19).contains(&i) => {
                Ok(vec![i as i32])
            }
            Some(Num::F(f))
                if f.fract() == 0.0
                    && ([-1.0, 127.0].contains(&f) || (1.0..=19.0).contains(&f)) =>
            {
                Ok(vec![f as i32])
            }
            _ => Err(bad_value(&format!("Invalid numerical type code: {other}"))),
        },
    }
}

fn type_number(v: &Bson) -> i32 {
    match v.element_type() as u8 {
        0xFF => -1,
        t => i32::from(t),
    }
}

fn parse_ops(ops: &Document) -> Result<Vec<Pred>, MongoError> {
    let mut preds = Vec::new();
    for (op, arg) in ops {
        let array = |what: &str| -> Result<Vec<Bson>, MongoError> {
            match arg {
                Bson::Array(items) => {
                    if items
                        .iter()
                        .any(|i| matches!(i, Bson::RegularExpression(_)))
                    {
                        return Err(bad_value("the model does not match regular expressions"));
                    }
                    Ok(items.clone())
                }
                _ => Err(bad_value(&format!("{what} needs an array"))),
            }
        };
        preds.push(match op.as_str() {
            "$eq" => Pred::Eq(arg.clone()),
            "$ne" => Pred::Ne(arg.clone()),
            "$gt" => Pred::Cmp(CmpOp::Gt, arg.clone()),
            "$gte" => Pred::Cmp(CmpOp::Gte, arg.clone()),
            "$lt" => Pred::Cmp(CmpOp::Lt, arg.clone()),
            "$lte" => Pred::Cmp(CmpOp::Lte, arg.clone()),
            "$in" => Pred::In(array("$in")?),
            "$nin" => Pred::Nin(array("$nin")?),
            "$exists" => Pred::Exists(truthy(arg)),
            "$type" => match arg {
                Bson::Array(items) => {
                    let mut codes = Vec::new();
                    for i in items {
                        codes.extend(type_code(i)?);
                    }
                    Pred::Type(codes)
                }
                one => Pred::Type(type_code(one)?),
            },
            "$not" => match arg {
                Bson::Document(d) if !d.is_empty() && is_operator_doc(arg).is_some() => {
                    Pred::Not(parse_ops(d)?)
                }
                Bson::RegularExpression(_) => {
                    return Err(bad_value("the model does not match regular expressions"));
                }
                _ => return Err(bad_value("$not needs a regex or a document")),
            },
            "$size" => match num(arg) {
                Some(Num::I(n)) if n >= 0 => Pred::Size(n as usize),
                Some(Num::F(f)) if f >= 0.0 && f.fract() == 0.0 => Pred::Size(f as usize),
                _ => return Err(bad_value("$size needs a non-negative whole number")),
            },
            "$all" | "$elemMatch" | "$regex" | "$mod" | "$where" | "$expr" | "$options"
            | "$bitsAllSet" | "$bitsAnySet" | "$bitsAllClear" | "$bitsAnyClear" => {
                return Err(bad_value(&format!("the model does not support {op}")));
            }
            other => return Err(bad_value(&format!("unknown operator: {other}"))),
        });
    }
    Ok(preds)
}

/// Whether the query `expr` matches `doc`.
pub fn matches(expr: &Expr, doc: &Document) -> bool {
    match expr {
        Expr::And(xs) => xs.iter().all(|x| matches(x, doc)),
        Expr::Or(xs) => xs.iter().any(|x| matches(x, doc)),
        Expr::Nor(xs) => !xs.iter().any(|x| matches(x, doc)),
        Expr::Path(path, preds) => {
            let values = path_values(doc, path);
            preds.iter().all(|p| pred_holds(p, &values))
        }
    }
}

/// The value itself, and its elements when it is an array.
fn each<'a>(v: &'a Bson) -> impl Iterator<Item = &'a Bson> {
    let elements: &'a [Bson] = match v {
        Bson::Array(items) => items,
        _ => &[],
    };
    std::iter::once(v).chain(elements.iter())
}

fn eq_any(values: &[Option<&Bson>], x: &Bson) -> bool {
    values.iter().any(|v| match v {
        None => matches!(x, Bson::Null),
        Some(v) => each(v).any(|e| equal(e, x)),
    })
}

fn cmp_holds(v: &Bson, op: CmpOp, x: &Bson) -> bool {
    if type_rank(v) != type_rank(x) {
        return false;
    }
    if is_nan(v) || is_nan(x) {
        return is_nan(v) && is_nan(x) && matches!(op, CmpOp::Lte | CmpOp::Gte);
    }
    let o = compare(v, x);
    match op {
        CmpOp::Lt => o == Ordering::Less,
        CmpOp::Lte => o != Ordering::Greater,
        CmpOp::Gt => o == Ordering::Greater,
        CmpOp::Gte => o != Ordering::Less,
    }
}

fn pred_holds(p: &Pred, values: &[Option<&Bson>]) -> bool {
    match p {
        Pred::Eq(x) => eq_any(values, x),
        Pred::Ne(x) => !eq_any(values, x),
        Pred::Cmp(op, x) => values.iter().any(|v| match v {
            None => matches!(x, Bson::Null) && matches!(op, CmpOp::Lte | CmpOp::Gte),
            Some(v) => each(v).any(|e| cmp_holds(e, *op, x)),
        }),
        Pred::In(xs) => xs.iter().any(|x| eq_any(values, x)),
        Pred::Nin(xs) => !xs.iter().any(|x| eq_any(values, x)),
        Pred::Exists(want) => values.iter().any(Option::is_some) == *want,
        Pred::Type(codes) => values
            .iter()
            .flatten()
            .any(|v| each(v).any(|e| type_is(e, codes))),
        Pred::Not(ps) => !ps.iter().all(|p| pred_holds(p, values)),
        Pred::Size(n) => values
            .iter()
            .flatten()
            .any(|v| matches!(v, Bson::Array(items) if items.len() == *n)),
    }
}

fn type_is(v: &Bson, codes: &[i32]) -> bool {
    codes.contains(&type_number(v))
}

// ---------------------------------------------------------------------------------------------
// Sort and projection
// ---------------------------------------------------------------------------------------------

fn parse_sort(sort: &Document) -> Result<Vec<(String, bool)>, MongoError> {
    let mut keys = Vec::new();
    for (k, v) in sort {
        let direction = match num(v) {
            Some(Num::I(i)) => Some(i),
            Some(Num::F(f)) if f.fract() == 0.0 && f.abs() <= 1.0 => Some(f as i64),
            _ => None,
        };
        let ascending = match direction {
            Some(1) => true,
            Some(-1) => false,
            _ => return Err(bad_value(&format!("bad sort specification for {k}"))),
        };
        keys.push((k.clone(), ascending));
    }
    Ok(keys)
}

/// The key a document sorts by on `path`: the least (ascending) or greatest (descending) value
/// the path reaches, elements of arrays in place of the arrays; missing is null; an empty array
/// sorts below null.
fn sort_key(doc: &Document, path: &str, ascending: bool) -> Bson {
    let mut candidates: Vec<Bson> = Vec::new();
    for v in path_values(doc, path) {
        match v {
            None => candidates.push(Bson::Null),
            Some(Bson::Array(items)) if items.is_empty() => candidates.push(Bson::Undefined),
            Some(Bson::Array(items)) => candidates.extend(items.iter().cloned()),
            Some(v) => candidates.push(v.clone()),
        }
    }
    let pick = candidates.into_iter().reduce(|a, b| {
        let o = compare(&a, &b);
        if (ascending && o == Ordering::Greater) || (!ascending && o == Ordering::Less) {
            b
        } else {
            a
        }
    });
    pick.unwrap_or(Bson::Null)
}

fn sort_docs(docs: &mut [Document], keys: &[(String, bool)]) {
    if keys.is_empty() {
        return;
    }
    let mut keyed: Vec<(Vec<Bson>, Document)> = docs
        .iter()
        .map(|d| {
            (
                keys.iter().map(|(p, asc)| sort_key(d, p, *asc)).collect(),
                d.clone(),
            )
        })
        .collect();
    keyed.sort_by(|(a, _), (b, _)| {
        for (i, (_, asc)) in keys.iter().enumerate() {
            let o = compare(&a[i], &b[i]);
            let o = if *asc { o } else { o.reverse() };
            if o != Ordering::Equal {
                return o;
            }
        }
        Ordering::Equal
    });
    for (slot, (_, d)) in docs.iter_mut().zip(keyed) {
        *slot = d;
    }
}

/// Sorts `docs` by a sort specification, stably, as `find` does (for checkers and tests).
pub fn sort_for_test(docs: &mut [Document], sort: &Document) {
    if let Ok(keys) = parse_sort(sort) {
        sort_docs(docs, &keys);
    }
}

/// Whether `a` and `b` have equal sort keys under `sort` (their order is then the server's).
pub fn sort_keys_equal(a: &Document, b: &Document, sort: &Document) -> bool {
    parse_sort(sort).is_ok_and(|keys| {
        keys.iter()
            .all(|(p, asc)| equal(&sort_key(a, p, *asc), &sort_key(b, p, *asc)))
    })
}

/// An inclusion or exclusion projection, as `find` applies it.
pub fn project(doc: &Document, projection: &Document) -> Result<Document, MongoError> {
    let mut include_id = true;
    let mut included: Vec<&str> = Vec::new();
    let mut excluded: Vec<&str> = Vec::new();
    for (k, v) in projection {
        if matches!(v, Bson::Document(_) | Bson::String(_) | Bson::Array(_)) {
            return Err(bad_value(
                "the model supports only inclusion and exclusion projections",
            ));
        }
        if k == "_id" {
            include_id = truthy(v);
        } else if truthy(v) {
            included.push(k);
        } else {
            excluded.push(k);
        }
    }
    if !included.is_empty() && !excluded.is_empty() {
        return Err(command_error(
            31254,
            "Location31254",
            "Cannot do exclusion on a field in inclusion projection",
        ));
    }
    let mut out = Document::new();
    // `{_id: 1}` alone is an inclusion of `_id` only.
    let id_only = included.is_empty() && excluded.is_empty() && include_id;
    if !included.is_empty() || id_only {
        if include_id && let Some(id) = doc.get("_id") {
            out.insert("_id", id.clone());
        }
        include_paths(doc, &included, &mut out);
        return Ok(out);
    }
    let mut out = doc.clone();
    if !include_id {
        out.remove("_id");
    }
    for path in excluded {
        unset_path(&mut out, path);
    }
    Ok(out)
}

fn include_paths(doc: &Document, paths: &[&str], out: &mut Document) {
    for (k, v) in doc {
        if k == "_id" {
            continue;
        }
        if paths.contains(&k.as_str()) {
            out.insert(k.clone(), v.clone());
            continue;
        }
        let prefix = format!("{k}.");
        let below: Vec<&str> = paths
            .iter()
            .filter_map(|p| p.strip_prefix(&prefix))
            .collect();
        if below.is_empty() {
            continue;
        }
        match v {
            Bson::Document(d) => {
                let mut sub = Document::new();
                include_paths(d, &below, &mut sub);
                out.insert(k.clone(), sub);
            }
            Bson::Array(items) => {
                let kept: Vec<Bson> = items
                    .iter()
                    .filter_map(|i| match i {
                        Bson::Document(d) => {
                            let mut sub = Document::new();
                            include_paths(d, &below, &mut sub);
                            Some(Bson::Document(sub))
                        }
                        _ => None,
                    })
                    .collect();
                out.insert(k.clone(), kept);
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Updates
// ---------------------------------------------------------------------------------------------

fn failed_to_parse(message: &str) -> MongoError {
    command_error(9, "FailedToParse", message)
}

fn set_path(doc: &mut Document, path: &str, value: Bson) -> Result<(), MongoError> {
    let (first, rest) = match path.split_once('.') {
        Some((a, b)) => (a, Some(b)),
        None => (path, None),
    };
    let Some(rest) = rest else {
        doc.insert(first, value);
        return Ok(());
    };
    if !doc.contains_key(first) {
        doc.insert(first, Document::new());
    }
    match doc.get_mut(first) {
        Some(Bson::Document(d)) => set_path(d, rest, value),
        Some(Bson::Array(items)) => {
            let (index, more) = match rest.split_once('.') {
                Some((a, b)) => (a, Some(b)),
                None => (rest, None),
            };
            let Ok(i) = index.parse::<usize>() else {
                return Err(command_error(
                    28,
                    "PathNotViable",
                    &format!("Cannot create field '{index}' in an array"),
                ));
            };
            while items.len() <= i {
                items.push(Bson::Null);
            }
            match (more, items.get_mut(i)) {
                (None, Some(slot)) => {
                    *slot = value;
                    Ok(())
                }
                (Some(more), Some(slot)) => {
                    if !matches!(slot, Bson::Document(_)) {
                        if matches!(slot, Bson::Null) {
                            *slot = Bson::Document(Document::new());
                        } else {
                            return Err(command_error(
                                28,
                                "PathNotViable",
                                &format!("Cannot create field '{more}' in element"),
                            ));
                        }
                    }
                    match slot {
                        Bson::Document(d) => set_path(d, more, value),
                        _ => Ok(()),
                    }
                }
                _ => Ok(()),
            }
        }
        Some(other) => Err(command_error(
            28,
            "PathNotViable",
            &format!("Cannot create field '{rest}' in element {{{first}: {other}}}"),
        )),
        None => Ok(()),
    }
}

fn unset_path(doc: &mut Document, path: &str) {
    match path.split_once('.') {
        None => {
            doc.remove(path);
        }
        Some((first, rest)) => match doc.get_mut(first) {
            Some(Bson::Document(d)) => unset_path(d, rest),
            Some(Bson::Array(items)) => {
                if let Ok(i) = rest.parse::<usize>()
                    && let Some(slot) = items.get_mut(i)
                {
                    *slot = Bson::Null;
                }
            }
            _ => {}
        },
    }
}

#[derive(Debug)]
enum Change {
    Set(Bson),
    Unset,
    Inc(Bson),
    Min(Bson),
    Max(Bson),
}

/// Applies an update document (`$set`, `$unset`, `$inc`, `$setOnInsert`, `$min`, `$max`) to a
/// copy of `doc`. Fields are visited in lexicographic order of their paths, as MongoDB 5+ does,
/// so new fields land in that order.
pub fn apply_update(
    doc: &Document,
    update: &Document,
    inserting: bool,
) -> Result<Document, MongoError> {
    if update.is_empty() {
        return Err(failed_to_parse("Update document requires atomic operators"));
    }
    let mut changes: Vec<(String, Change)> = Vec::new();
    for (op, fields) in update {
        let Bson::Document(fields) = fields else {
            return Err(failed_to_parse(&format!(
                "Modifiers operate on fields but we found type {:?} instead",
                fields.element_type()
            )));
        };
        for (path, v) in fields {
            let change = match op.as_str() {
                "$set" => Change::Set(v.clone()),
                "$setOnInsert" if inserting => Change::Set(v.clone()),
                "$setOnInsert" => continue,
                "$unset" => Change::Unset,
                "$inc" => {
                    if num(v).is_none() {
                        return Err(command_error(
                            14,
                            "TypeMismatch",
                            &format!("Cannot increment with non-numeric argument: {{{path}: {v}}}"),
                        ));
                    }
                    Change::Inc(v.clone())
                }
                "$min" => Change::Min(v.clone()),
                "$max" => Change::Max(v.clone()),
                other if other.starts_with('$') => {
                    return Err(failed_to_parse(&format!(
                        "Unknown modifier: {other} (or not modelled)"
                    )));
                }
                _ => return Err(failed_to_parse("Update document requires atomic operators")),
            };
            changes.push((path.clone(), change));
        }
    }
    changes.sort_by(|a, b| a.0.cmp(&b.0));
    for pair in changes.windows(2) {
        if let [(a, _), (b, _)] = pair
            && (a == b || b.starts_with(&format!("{a}.")))
        {
            return Err(command_error(
                40,
                "ConflictingUpdateOperators",
                &format!("Updating the path '{b}' would create a conflict at '{a}'"),
            ));
        }
    }
    let mut out = doc.clone();
    for (path, change) in changes {
        let current = get_path(&out, &path).cloned();
        match change {
            Change::Set(v) => set_path(&mut out, &path, v)?,
            Change::Unset => unset_path(&mut out, &path),
            Change::Inc(by) => {
                let sum = match (current.as_ref().map(num), num(&by)) {
                    (None, _) => by.clone(),
                    (Some(None), _) => {
                        return Err(command_error(
                            14,
                            "TypeMismatch",
                            &format!(
                                "Cannot apply $inc to a value of non-numeric type at '{path}'"
                            ),
                        ));
                    }
                    (Some(Some(a)), Some(b)) => add(current.as_ref(), a, &by, b)?,
                    (Some(Some(_)), None) => by.clone(),
                };
                set_path(&mut out, &path, sum)?;
            }
            Change::Min(v) => min_max(&mut out, &path, current.as_ref(), v, Ordering::Less)?,
            Change::Max(v) => min_max(&mut out, &path, current.as_ref(), v, Ordering::Greater)?,
        }
    }
    if let (Some(before), Some(after)) = (doc.get("_id"), out.get("_id"))
        && !same_value(before, after)
    {
        return Err(immutable_id());
    }
    Ok(out)
}

fn min_max(
    out: &mut Document,
    path: &str,
    current: Option<&Bson>,
    v: Bson,
    wanted: Ordering,
) -> Result<(), MongoError> {
    let replace = current.is_none_or(|c| compare(&v, c) == wanted);
    if replace {
        set_path(out, path, v)?;
    }
    Ok(())
}

fn immutable_id() -> MongoError {
    command_error(
        66,
        "ImmutableField",
        "Performing an update on the path '_id' would modify the immutable field '_id'",
    )
}

fn same_value(a: &Bson, b: &Bson) -> bool {
    same_bytes(&doc! { "": a.clone() }, &doc! { "": b.clone() })
}

fn add(current: Option<&Bson>, a: Num, by: &Bson, b: Num) -> Result<Bson, MongoError> {
    let decimal = matches!(current, Some(Bson::Decimal128(_))) || matches!(by, Bson::Decimal128(_));
    if decimal {
        return Err(failed_to_parse("the model does not add Decimal128 values"));
    }
    Ok(match (current, by, a, b) {
        (Some(Bson::Int32(x)), Bson::Int32(y), _, _) => match x.checked_add(*y) {
            Some(s) => Bson::Int32(s),
            None => Bson::Int64(i64::from(*x) + i64::from(*y)),
        },
        (_, _, Num::I(x), Num::I(y)) => match x.checked_add(y) {
            Some(s) => Bson::Int64(s),
            None => return Err(bad_value("Failed to apply $inc operations: overflow")),
        },
        (_, _, x, y) => {
            let f = |n: Num| match n {
                Num::I(i) => i as f64,
                Num::F(f) => f,
            };
            Bson::Double(f(x) + f(y))
        }
    })
}

/// The document an upsert starts from: the equalities of the filter (top level and within
/// `$and`), `_id` first.
fn upsert_seed(filter: &Document) -> Result<Document, MongoError> {
    let mut seed = Document::new();
    fn walk(filter: &Document, seed: &mut Document) -> Result<(), MongoError> {
        for (k, v) in filter {
            if k == "$and" {
                if let Bson::Array(items) = v {
                    for item in items {
                        if let Bson::Document(d) = item {
                            walk(d, seed)?;
                        }
                    }
                }
                continue;
            }
            if k.starts_with('$') {
                continue;
            }
            match is_operator_doc(v) {
                Some(ops) => {
                    if let Some(eq) = ops.get("$eq") {
                        set_path(seed, k, eq.clone())?;
                    }
                }
                None => set_path(seed, k, v.clone())?,
            }
        }
        Ok(())
    }
    walk(filter, &mut seed)?;
    Ok(seed)
}

fn id_first(doc: Document, id: Bson) -> Document {
    let mut out = doc! { "_id": id };
    for (k, v) in doc {
        if k != "_id" {
            out.insert(k, v);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

/// A delay, drawn from the model's generator.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Latency {
    #[default]
    Zero,
    Fixed(Duration),
    /// Uniform between the two bounds.
    Uniform(Duration, Duration),
}

/// What can go wrong with one request, each drawn per request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// The server's time to run the operation, before its effect (counts against `maxTimeMS`).
    pub latency: Latency,
    /// The reply's way back, after the effect.
    pub reply_latency: Latency,
    /// Multi-document writes: `None` writes every document at once; `Some(l)` yields (and
    /// waits `l`) before each matching document after the first, so other operations run in
    /// between.
    pub per_document: Option<Latency>,
    /// The request never arrives: an I/O error, no effect.
    pub p_cut: f64,
    /// The operation runs, its reply is lost: an I/O error after the effect.
    pub p_lose_reply: f64,
    /// A command error (`error_code`) with no effect.
    pub p_error: f64,
    pub error_code: i32,
    /// A long pause before the operation runs.
    pub p_stall: f64,
    pub stall: Latency,
}

/// The faults of every operation name; `default` for those not named.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    pub default: Faults,
    /// By operation name (`find`, `count`, `distinct`, `updateOne`, `updateMany`,
    /// `replaceOne`, `findOneAndUpdate`, `deleteOne`, `deleteMany`, `insert`, `watch`) or
    /// command name (`hello`, `createIndexes`, ...).
    pub by_op: HashMap<String, Faults>,
}

impl FaultPlan {
    fn of(&self, name: &str) -> &Faults {
        self.by_op.get(name).unwrap_or(&self.default)
    }
}

/// Writes that take effect and still answer an error, as a replica set's can: the write is
/// applied on the primary, then its write concern fails and the reply carries a
/// `writeConcernError` (the driver returns `Write(WriteConcernError)`). Drawn per write
/// (update, replace, delete, insert, findAndModify) that ran without another error, from a
/// generator of its own (the other faults' draws stay as they were), after every other
/// fault of the request. A retryable write whose code is one the server labels
/// `RetryableWriteError` (91, 189, 11602, ...) is retried by the driver and answered with the
/// first run's result; 64 (WriteConcernFailed, a wtimeout) and every multi-document write
/// reach the caller.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AfterEffect {
    /// The chance per write.
    pub p: f64,
    /// The codes, one picked per fault (none: 64).
    pub codes: Vec<i32>,
}

/// What the `mongodb` driver does above the server, which the daemon's `Driver` backend
/// includes and the model therefore plays too (on by default, as against MongoDB):
/// - retryable writes (every single-document write and insert) and retryable reads (find,
///   count, distinct) are tried once more after a network error or a retryable code (10107,
///   11602, 91, 189, ...); a write retried after its reply was lost is not applied twice (the
///   server answers the retry with the first run's result);
/// - once a client saw the server unreachable or not primary, it waits (server selection, up
///   to `server_selection`) for a reachable primary before its next request, and a retry that
///   finds none returns the first error.
///
/// Multi-document writes (`updateMany`, `deleteMany`) and commands are never retried, so a
/// claim or a guarded remove during a stepdown sees NotWritablePrimary (10107).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriverModel {
    pub retries: bool,
    pub server_selection: Duration,
}

impl Default for DriverModel {
    fn default() -> Self {
        Self {
            retries: true,
            server_selection: Duration::from_secs(10),
        }
    }
}

/// Codes the driver retries (the server labels them RetryableWriteError; MongoDB 4.4+).
const RETRYABLE_CODES: [i32; 16] = [
    6, 7, 63, 89, 91, 134, 150, 189, 262, 9001, 10107, 11600, 11602, 13388, 13435, 13436,
];

fn retryable_error(e: &MongoError) -> bool {
    match e.kind.as_ref() {
        mongodb::error::ErrorKind::Io(_) => true,
        mongodb::error::ErrorKind::Command(c) => RETRYABLE_CODES.contains(&c.code),
        // The driver retries a write concern error only by its label (the server's).
        mongodb::error::ErrorKind::Write(mongodb::error::WriteFailure::WriteConcernError(_)) => {
            e.contains_label(RETRYABLE_WRITE_ERROR)
        }
        _ => false,
    }
}

/// Errors after which the driver no longer takes the server for a reachable primary (a
/// write concern error's code counts, as SDAM reads it).
fn marks_unknown(e: &MongoError) -> bool {
    match e.kind.as_ref() {
        mongodb::error::ErrorKind::Write(mongodb::error::WriteFailure::WriteConcernError(w)) => {
            RETRYABLE_CODES.contains(&w.code)
        }
        _ => retryable_error(e),
    }
}

const RETRYABLE_WRITE_ERROR: &str = "RetryableWriteError";

fn retryable_op(op: &Op) -> bool {
    !matches!(
        op,
        Op::Update { many: true, .. } | Op::Delete { many: true, .. }
    )
}

fn is_read(op: &Op) -> bool {
    matches!(op, Op::Find { .. } | Op::Count { .. } | Op::Distinct { .. })
}

/// splitmix64: the model's only source of randomness, seeded by the simulation.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }

    fn delay(&mut self, l: Latency) -> Duration {
        match l {
            Latency::Zero => Duration::ZERO,
            Latency::Fixed(d) => d,
            Latency::Uniform(a, b) if b > a => {
                let span = (b - a).as_micros() as u64;
                a + Duration::from_micros(self.next() % (span + 1))
            }
            Latency::Uniform(a, _) => a,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The operations log
// ---------------------------------------------------------------------------------------------

/// What a client asked.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Request {
    Op(Op),
    Command(Document),
    Watch(Vec<Document>),
}

/// One line of the operations log.
#[derive(Debug, Clone)]
pub struct LogEntry {
    pub seq: u64,
    /// The request this line belongs to.
    pub op_id: u64,
    pub client: String,
    pub collection: String,
    pub at: Instant,
    /// The server clock then (Unix ms).
    pub server_ms: i64,
    pub event: LogEvent,
}

#[derive(Debug, Clone)]
pub enum LogEvent {
    /// The request reached the server.
    Received { name: String, request: Request },
    /// The request never reached it (a cut).
    Cut,
    /// One document written: inserted (`before` none), updated, or deleted (`after` none).
    Wrote {
        id: Bson,
        before: Option<Document>,
        after: Option<Document>,
    },
    /// The `_id`s a read returned.
    Read { ids: Vec<Bson> },
    /// The operation ended on the server.
    Finished {
        error: Option<String>,
        written: Option<Written>,
    },
    /// The reply was lost on its way back (the client saw an I/O error).
    ReplyLost,
    /// The reply arrived after the client had given up on it.
    ClientGone,
}

// ---------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Collection {
    /// Record order (insertion) to document.
    docs: BTreeMap<u64, Document>,
    by_id: HashMap<String, u64>,
    /// Index specifications as `listIndexes` returns them, `_id_` first.
    indexes: Vec<Document>,
}

impl Collection {
    fn with_id_index() -> Self {
        Self {
            indexes: vec![doc! { "v": 2, "key": { "_id": 1 }, "name": "_id_" }],
            ..Self::default()
        }
    }
}

/// The server's clock: `anchor_us` (Unix µs) at `anchor`, running `drift_ppm` fast or slow
/// since. Kept in µs, so that moving the anchor (a step, a new drift) loses no fraction of a
/// millisecond: that would be a step back no fault recorded (simulation seed 16325, 1 ms
/// "early" past a recorded step of 159 ms).
#[derive(Debug, Clone, Copy)]
struct ServerClock {
    anchor: Instant,
    anchor_us: i64,
    drift_ppm: i64,
}

impl ServerClock {
    fn at_us(&self, now: Instant) -> i64 {
        let us = now.saturating_duration_since(self.anchor).as_micros() as i64;
        let drifted = us.saturating_add(us.saturating_mul(self.drift_ppm) / 1_000_000);
        self.anchor_us.saturating_add(drifted)
    }

    /// The server clock in Unix ms, as `$$NOW` and `hello.localTime` read it.
    fn at(&self, now: Instant) -> i64 {
        self.at_us(now).div_euclid(1000)
    }
}

#[derive(Debug, Clone)]
struct FailPoint {
    /// `None`: always on.
    remaining: Option<u64>,
    data: Document,
}

#[derive(Debug, Default, Clone)]
struct Counters {
    commands: BTreeMap<String, (u64, u64)>,
    returned: u64,
    inserted: u64,
    updated: u64,
    deleted: u64,
    killed_max_time: u64,
    /// Writes answered with a write concern error after their effect.
    errors_after_effect: u64,
}

#[derive(Debug)]
struct State {
    colls: BTreeMap<String, Collection>,
    next_seq: u64,
    next_op: u64,
    next_oid: u64,
    rng: SplitMix,
    faults: FaultPlan,
    client_faults: HashMap<String, FaultPlan>,
    clock: ServerClock,
    stepdown_until: Option<Instant>,
    /// Per client; `""` for every client.
    cut_until: HashMap<String, Instant>,
    stall_until: HashMap<String, Instant>,
    fail_command: Option<FailPoint>,
    max_time_always: Option<FailPoint>,
    set_name: Option<String>,
    log: Vec<LogEntry>,
    log_seq: u64,
    keep_log: bool,
    counters: Counters,
    started: Instant,
    event_seq: u64,
    driver: DriverModel,
    /// Clients that saw the server unreachable or not primary (they select before sending).
    unknown: std::collections::HashSet<String>,
    /// Results of retryable writes by transaction number: a retry is answered from here.
    txns: HashMap<u64, Reply>,
    next_txn: u64,
    /// Documents to insert just after the next claim read ran
    /// ([`MongoModel::insert_during_next_claim`]).
    armed: Vec<Armed>,
    /// Writes that answer an error after their effect, and their own generator.
    after_effect: AfterEffect,
    after_rng: SplitMix,
}

/// A document waiting for a claim read to land beside: its collection, the document, and
/// who hears the server's clock when it landed.
#[derive(Debug)]
struct Armed {
    collection: String,
    doc: Document,
    landed: oneshot::Sender<i64>,
}

/// How much longer the reply of a claim read waits when a document landed beside it: its
/// change event reaches the instance first, while that claim still runs.
const ARMED_REPLY_DELAY: Duration = Duration::from_millis(1);

#[derive(Debug, Clone)]
enum Broadcast {
    Event(String, Document),
    Cut,
}

#[derive(Debug)]
struct Inner {
    db: String,
    state: Mutex<State>,
    events: broadcast::Sender<Broadcast>,
}

/// The model: cheap to clone, one server shared by every clone. Each clone made with
/// [`MongoModel::client`] is one client (its name in the log, its own faults and cuts).
#[derive(Debug, Clone)]
pub struct MongoModel {
    inner: Arc<Inner>,
    client: Arc<str>,
}

fn io_error(kind: std::io::ErrorKind, what: &str) -> MongoError {
    MongoError::from(std::io::Error::new(kind, what.to_string()))
}

fn max_time_expired() -> MongoError {
    command_error(50, "MaxTimeMSExpired", "operation exceeded time limit")
}

fn not_primary() -> MongoError {
    command_error(10107, "NotWritablePrimary", "not primary")
}

fn write_error(code: i32, name: &str, message: &str) -> MongoError {
    let reply = doc! { "code": code, "codeName": name, "errmsg": message };
    match bson::from_document::<mongodb::error::WriteError>(reply) {
        Ok(e) => MongoError::from(mongodb::error::ErrorKind::Write(
            mongodb::error::WriteFailure::WriteError(e),
        )),
        Err(e) => MongoError::custom(format!("{name} ({code}): {message} [{e}]")),
    }
}

/// A reply's `writeConcernError` as the driver returns it: `Write(WriteConcernError)`, with
/// the reply's `errorLabels` (`RetryableWriteError` makes the driver retry it).
pub fn write_concern_error(wce: &Document, labels: &[String]) -> MongoError {
    let mut reply = wce.clone();
    reply.insert("errorLabels", labels.to_vec());
    match bson::from_document::<mongodb::error::WriteConcernError>(reply) {
        Ok(e) => MongoError::from(mongodb::error::ErrorKind::Write(
            mongodb::error::WriteFailure::WriteConcernError(e),
        )),
        Err(e) => MongoError::custom(format!("write concern error {wce}: [{e}]")),
    }
}

/// The `writeConcernError` of code `code` a primary reports once the write was applied.
fn wce_of(code: i32) -> Document {
    let (name, message) = match code {
        64 => ("WriteConcernFailed", "waiting for replication timed out"),
        91 => ("ShutdownInProgress", "Replication is being shut down"),
        189 => (
            "PrimarySteppedDown",
            "Primary stepped down while waiting for replication",
        ),
        11602 => (
            "InterruptedDueToReplStateChange",
            "operation was interrupted while waiting for replication",
        ),
        _ => ("ModelFault", "injected by the model after the effect"),
    };
    let mut wce = doc! { "code": code, "codeName": name, "errmsg": message };
    if code == 64 {
        wce.insert("errInfo", doc! { "wtimeout": true });
    }
    wce
}

/// A statement's error as a write error (a command error of the stepdown stays one).
fn as_write_error(e: MongoError) -> MongoError {
    match e.kind.as_ref() {
        mongodb::error::ErrorKind::Command(c) if ![10107, 11602].contains(&c.code) => {
            write_error(c.code, &c.code_name, &c.message)
        }
        _ => e,
    }
}

fn insert_many_error(errors: Vec<Document>) -> MongoError {
    let reply = doc! { "writeErrors": errors };
    match bson::from_document::<mongodb::error::InsertManyError>(reply) {
        Ok(e) => MongoError::from(mongodb::error::ErrorKind::InsertMany(e)),
        Err(e) => MongoError::custom(format!("insert many: {e}")),
    }
}

/// The server's command name of an operation (what `failCommand` names).
fn wire_name(request: &Request) -> String {
    match request {
        Request::Op(op) => match op {
            Op::Find { .. } => "find",
            Op::Count { .. } => "aggregate",
            Op::Distinct { .. } => "distinct",
            Op::Update { .. } | Op::Replace { .. } => "update",
            Op::FindOneAndUpdate { .. } => "findAndModify",
            Op::Delete { .. } => "delete",
            Op::Insert { .. } => "insert",
        }
        .to_string(),
        Request::Command(c) => c.keys().next().cloned().unwrap_or_default(),
        Request::Watch(_) => "aggregate".into(),
    }
}

/// The operation name faults are keyed by.
fn fault_name(request: &Request) -> String {
    match request {
        Request::Op(op) => op.name().to_string(),
        Request::Command(c) => c.keys().next().cloned().unwrap_or_default(),
        Request::Watch(_) => "watch".into(),
    }
}

fn is_write(request: &Request) -> bool {
    match request {
        Request::Op(op) => !matches!(op, Op::Find { .. } | Op::Count { .. } | Op::Distinct { .. }),
        Request::Command(c) => matches!(
            c.keys().next().map(String::as_str),
            Some("createIndexes" | "dropIndexes" | "collMod" | "drop" | "dropDatabase")
        ),
        Request::Watch(_) => false,
    }
}

fn max_time_of(request: &Request) -> Option<Duration> {
    match request {
        Request::Op(
            Op::Find { max_time, .. }
            | Op::Count { max_time, .. }
            | Op::Distinct { max_time, .. }
            | Op::FindOneAndUpdate { max_time, .. },
        ) => *max_time,
        Request::Command(c) => match c.get("maxTimeMS").and_then(num) {
            Some(Num::I(ms)) if ms > 0 => Some(Duration::from_millis(ms as u64)),
            Some(Num::F(ms)) if ms >= 1.0 => Some(Duration::from_millis(ms as u64)),
            _ => None,
        },
        _ => None,
    }
}

enum Response {
    Reply(Reply),
    Command(Document),
    Stream(ChangeStream),
}

impl MongoModel {
    /// A server for database `db`, its clock at `start_ms` (Unix ms) now, faults drawn from
    /// `seed`.
    pub fn new(db: &str, seed: u64, start_ms: i64) -> Self {
        let now = Instant::now();
        let (events, _) = broadcast::channel(4096);
        let state = State {
            colls: BTreeMap::new(),
            next_seq: 0,
            next_op: 0,
            next_oid: 0,
            rng: SplitMix(seed),
            faults: FaultPlan::default(),
            client_faults: HashMap::new(),
            clock: ServerClock {
                anchor: now,
                anchor_us: start_ms.saturating_mul(1000),
                drift_ppm: 0,
            },
            stepdown_until: None,
            cut_until: HashMap::new(),
            stall_until: HashMap::new(),
            fail_command: None,
            max_time_always: None,
            set_name: None,
            log: Vec::new(),
            log_seq: 0,
            keep_log: true,
            counters: Counters::default(),
            started: now,
            event_seq: 0,
            driver: DriverModel::default(),
            unknown: std::collections::HashSet::new(),
            txns: HashMap::new(),
            next_txn: 0,
            armed: Vec::new(),
            after_effect: AfterEffect::default(),
            after_rng: SplitMix(seed ^ 0x0AF7_E2EF_FEC7),
        };
        Self {
            inner: Arc::new(Inner {
                db: db.to_string(),
                state: Mutex::new(state),
                events,
            }),
            client: Arc::from(""),
        }
    }

    /// The same server, as the client `name`.
    pub fn client(&self, name: &str) -> Self {
        Self {
            inner: self.inner.clone(),
            client: Arc::from(name),
        }
    }

    /// This handle's client name.
    pub fn client_name(&self) -> &str {
        &self.client
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    // -- configuration and faults ------------------------------------------------------------

    /// The faults of every client without faults of its own.
    pub fn set_faults(&self, plan: FaultPlan) {
        self.lock().faults = plan;
    }

    /// How many writes answered a write concern error after their effect so far.
    pub fn errors_after_effect(&self) -> u64 {
        self.lock().counters.errors_after_effect
    }

    /// The faults of one client.
    pub fn set_client_faults(&self, client: &str, plan: FaultPlan) {
        self.lock().client_faults.insert(client.to_string(), plan);
    }

    /// No faults from now on (the simulation's liveness phase); windows already open close.
    pub fn heal(&self) {
        let mut s = self.lock();
        s.faults = FaultPlan::default();
        s.client_faults.clear();
        s.cut_until.clear();
        s.stall_until.clear();
        s.stepdown_until = None;
        s.fail_command = None;
        s.max_time_always = None;
        s.after_effect = AfterEffect::default();
    }

    /// Writes answer a write concern error after their effect with chance `p`, with a code
    /// picked from `codes` ([`AfterEffect`]); `p` 0 ends it.
    pub fn set_error_after_effect(&self, p: f64, codes: &[i32]) {
        self.lock().after_effect = AfterEffect {
            p,
            codes: codes.to_vec(),
        };
    }

    /// Every client's requests fail with an I/O error for `d`; open change streams end.
    pub fn cut_for(&self, d: Duration) {
        self.cut_client_for("", d);
    }

    /// `client`'s requests fail with an I/O error for `d` (`""`: every client).
    pub fn cut_client_for(&self, client: &str, d: Duration) {
        self.lock()
            .cut_until
            .insert(client.to_string(), Instant::now() + d);
        let _ = self.inner.events.send(Broadcast::Cut);
    }

    /// Requests (of `client`, `""` for all) wait unanswered for `d`, then run.
    pub fn stall_client_for(&self, client: &str, d: Duration) {
        self.lock()
            .stall_until
            .insert(client.to_string(), Instant::now() + d);
    }

    /// For `d`, `hello` says not primary and writes fail with NotWritablePrimary (10107); a
    /// multi-document write in progress stops with InterruptedDueToReplStateChange (11602).
    pub fn step_down_for(&self, d: Duration) {
        self.lock().stepdown_until = Some(Instant::now() + d);
    }

    /// Whether `hello` says writable primary now.
    pub fn is_primary(&self) -> bool {
        self.lock()
            .stepdown_until
            .is_none_or(|t| Instant::now() >= t)
    }

    /// Moves the server clock by `ms` (an NTP step).
    pub fn step_clock_ms(&self, ms: i64) {
        let mut s = self.lock();
        let now = Instant::now();
        let at = s.clock.at_us(now);
        s.clock = ServerClock {
            anchor: now,
            anchor_us: at.saturating_add(ms.saturating_mul(1000)),
            drift_ppm: s.clock.drift_ppm,
        };
    }

    /// Makes the server clock run fast (positive) or slow by `ppm` parts per million.
    pub fn set_drift_ppm(&self, ppm: i64) {
        let mut s = self.lock();
        let now = Instant::now();
        let at = s.clock.at_us(now);
        s.clock = ServerClock {
            anchor: now,
            anchor_us: at,
            drift_ppm: ppm,
        };
    }

    /// The server clock now (Unix ms).
    pub fn server_ms(&self) -> i64 {
        self.lock().clock.at(Instant::now())
    }

    /// The server clock now.
    pub fn server_now(&self) -> DateTime {
        DateTime::from_millis(self.server_ms())
    }

    /// `hello` reports this replica set name (none: a standalone-like reply, as SecantusDB's).
    pub fn set_replica_set(&self, name: Option<&str>) {
        self.lock().set_name = name.map(str::to_string);
    }

    /// The driver's behaviour above the server ([`DriverModel`]).
    pub fn set_driver(&self, driver: DriverModel) {
        self.lock().driver = driver;
    }

    /// Keep the operations log (on by default).
    pub fn keep_log(&self, on: bool) {
        self.lock().keep_log = on;
    }

    // -- accessors for the checker ------------------------------------------------------------

    /// The documents of `collection`, in record order.
    pub fn snapshot(&self, collection: &str) -> Vec<Document> {
        self.lock()
            .colls
            .get(collection)
            .map(|c| c.docs.values().cloned().collect())
            .unwrap_or_default()
    }

    /// One document by `_id`.
    pub fn get(&self, collection: &str, id: &Bson) -> Option<Document> {
        let s = self.lock();
        let c = s.colls.get(collection)?;
        c.by_id
            .get(&id_key(id))
            .and_then(|seq| c.docs.get(seq))
            .cloned()
    }

    /// The index specifications of `collection`.
    pub fn indexes(&self, collection: &str) -> Vec<Document> {
        self.lock()
            .colls
            .get(collection)
            .map(|c| c.indexes.clone())
            .unwrap_or_default()
    }

    /// The whole operations log so far.
    pub fn log(&self) -> Vec<LogEntry> {
        self.lock().log.clone()
    }

    /// The log lines after `seq` (0: all).
    pub fn log_since(&self, seq: u64) -> Vec<LogEntry> {
        let s = self.lock();
        let start = s.log.partition_point(|e| e.seq <= seq);
        s.log
            .get(start..)
            .map(<[LogEntry]>::to_vec)
            .unwrap_or_default()
    }

    /// Drops the log lines kept so far.
    pub fn clear_log(&self) {
        self.lock().log.clear();
    }

    /// Inserts documents directly (the simulation's setup; no faults, logged as client `setup`).
    pub fn insert_direct(&self, collection: &str, docs: Vec<Document>) -> Result<(), MongoError> {
        let mut s = self.lock();
        let op_id = s.next_op_id();
        for d in docs {
            s.insert_one(&self.inner, "setup", op_id, collection, d)?;
        }
        Ok(())
    }

    /// Inserts `doc` into `collection` (as [`MongoModel::insert_direct`]) just after the
    /// next claim read of it ran (a `find` sorted by `Time`, by any instance), and before its
    /// reply leaves: the read missed the document, and its change event reaches the instance
    /// while that claim still runs. A wake-up that instance drops leaves the record to the
    /// next poll (the `late` invariant). The receiver hears the server's clock at the insert.
    pub fn insert_during_next_claim(
        &self,
        collection: &str,
        doc: Document,
    ) -> oneshot::Receiver<i64> {
        let (landed, rx) = oneshot::channel();
        self.lock().armed.push(Armed {
            collection: collection.to_string(),
            doc,
            landed,
        });
        rx
    }

    /// Lands the documents armed for `collection` if `request` was a claim read that ran;
    /// returns whether any landed.
    fn land_armed(
        &self,
        collection: &str,
        request: &Request,
        result: &Result<Response, MongoError>,
    ) -> bool {
        let claim_read = matches!(
            request,
            Request::Op(Op::Find { sort: Some(sort), .. })
                if sort.keys().any(|k| k.starts_with("Time"))
        );
        if !claim_read || result.is_err() {
            return false;
        }
        let landing: Vec<Armed> = {
            let mut s = self.lock();
            let (landing, kept) = std::mem::take(&mut s.armed)
                .into_iter()
                .partition(|a| a.collection == collection);
            s.armed = kept;
            landing
        };
        for a in &landing {
            let _ = self.insert_direct(collection, vec![a.doc.clone()]);
        }
        let server_ms = self.server_ms();
        let landed = !landing.is_empty();
        for a in landing {
            let _ = a.landed.send(server_ms);
        }
        landed
    }

    /// Runs one single-document operation at once and atomically, with no fault (the
    /// simulation's operator: `timeoutd reschedule` or `timeoutd cancel` of one record, its
    /// write landing at one instant the checker sees).
    pub fn run_direct(&self, collection: &str, op: &Op) -> Result<Reply, MongoError> {
        let mut s = self.lock();
        let op_id = s.next_op_id();
        s.execute_atomic(&self.inner, "operator", op_id, collection, op)
    }

    // -- serving ------------------------------------------------------------------------------

    fn submit(
        &self,
        collection: String,
        request: Request,
        txn: Option<u64>,
    ) -> oneshot::Receiver<Result<Response, MongoError>> {
        let (tx, rx) = oneshot::channel();
        let me = self.clone();
        tokio::spawn(async move {
            let (op_id, out) = me.serve(&collection, request, txn).await;
            let lost =
                matches!(&out, Err(e) if matches!(*e.kind, mongodb::error::ErrorKind::Io(_)));
            if tx.send(out).is_err() && !lost {
                me.lock()
                    .log(&me.client, op_id, &collection, LogEvent::ClientGone);
            }
        });
        rx
    }

    async fn serve(
        &self,
        collection: &str,
        request: Request,
        txn: Option<u64>,
    ) -> (u64, Result<Response, MongoError>) {
        let name = fault_name(&request);
        let wire = wire_name(&request);
        let max_time = max_time_of(&request);
        let client = self.client.to_string();
        // Draw every fault of this request at once, in arrival order.
        let (op_id, faults, cut, stall, latency, reply_latency, lose, error, after) = {
            let mut s = self.lock();
            let op_id = s.next_op_id();
            let plan = s.client_faults.get(&client).unwrap_or(&s.faults);
            let faults = plan.of(&name).clone();
            let now = Instant::now();
            let cut = s.cut_until.get(&client).is_some_and(|t| now < *t)
                || s.cut_until.get("").is_some_and(|t| now < *t)
                || s.rng.chance(faults.p_cut);
            let stall = if s.rng.chance(faults.p_stall) {
                s.rng.delay(faults.stall)
            } else {
                Duration::ZERO
            };
            let latency = s.rng.delay(faults.latency);
            let reply_latency = s.rng.delay(faults.reply_latency);
            let lose = s.rng.chance(faults.p_lose_reply);
            let error = s.rng.chance(faults.p_error);
            // From a generator of its own: the draws above stay as they were without it.
            let after = if matches!(request, Request::Op(_)) && is_write(&request) {
                let p = s.after_effect.p;
                if s.after_rng.chance(p) {
                    let n = s.after_effect.codes.len() as u64;
                    let i = if n > 1 { s.after_rng.next() % n } else { 0 };
                    Some(s.after_effect.codes.get(i as usize).copied().unwrap_or(64))
                } else {
                    None
                }
            } else {
                None
            };
            (
                op_id,
                faults,
                cut,
                stall,
                latency,
                reply_latency,
                lose,
                error,
                after,
            )
        };
        if cut {
            self.lock().log(&client, op_id, collection, LogEvent::Cut);
            return (
                op_id,
                Err(io_error(
                    std::io::ErrorKind::ConnectionReset,
                    "connection reset (model: cut)",
                )),
            );
        }
        // A stalled server holds the request, then runs it.
        let stalled_until = {
            let s = self.lock();
            [s.stall_until.get(&client), s.stall_until.get("")]
                .into_iter()
                .flatten()
                .max()
                .copied()
        };
        if let Some(t) = stalled_until
            && Instant::now() < t
        {
            tokio::time::sleep_until(t).await;
        }
        if !stall.is_zero() {
            tokio::time::sleep(stall).await;
        }
        let arrived = Instant::now();
        {
            let mut s = self.lock();
            s.log(
                &client,
                op_id,
                collection,
                LogEvent::Received {
                    name: name.clone(),
                    request: request.clone(),
                },
            );
            s.counters.commands.entry(wire.clone()).or_default().0 += 1;
        }
        // A write concern error to answer once the write took effect: drawn, or set by a
        // `failCommand` with `writeConcernError` (with its `errorLabels`).
        let mut wce = after.map(|code| (wce_of(code), None));
        let result = self
            .run_on_server(
                op_id, collection, &request, &wire, max_time, arrived, latency, error, &faults,
                txn, &mut wce,
            )
            .await;
        let written = match &result {
            Ok(Response::Reply(Reply::Written(w))) => Some(w.clone()),
            _ => None,
        };
        // The write took effect (its documents are in the log); the reply is the error. On a
        // retryable write the server labels a retryable code `RetryableWriteError`, as MongoDB
        // 4.4+ does, unless the failpoint named the labels.
        let result = match (result, wce) {
            (Ok(Response::Reply(_)), Some((wce, labels)))
                if matches!(request, Request::Op(_)) && is_write(&request) =>
            {
                let labels = labels.unwrap_or_else(|| {
                    let code = wce.get_i32("code").unwrap_or(0);
                    if txn.is_some() && RETRYABLE_CODES.contains(&code) {
                        vec![RETRYABLE_WRITE_ERROR.to_string()]
                    } else {
                        Vec::new()
                    }
                });
                self.lock().counters.errors_after_effect += 1;
                Err(write_concern_error(&wce, &labels))
            }
            (result, _) => result,
        };
        {
            let mut s = self.lock();
            if result.is_err() {
                s.counters.commands.entry(wire.clone()).or_default().1 += 1;
            }
            s.log(
                &client,
                op_id,
                collection,
                LogEvent::Finished {
                    error: result.as_ref().err().map(|e| e.to_string()),
                    written,
                },
            );
        }
        if self.land_armed(collection, &request, &result) {
            tokio::time::sleep(ARMED_REPLY_DELAY).await;
        }
        if !reply_latency.is_zero() {
            tokio::time::sleep(reply_latency).await;
        }
        // A cut that began while the request ran loses its reply (the effect stays).
        let cut_now = {
            let s = self.lock();
            let now = Instant::now();
            [s.cut_until.get(&client), s.cut_until.get("")]
                .into_iter()
                .flatten()
                .any(|t| now < *t)
        };
        if lose || cut_now {
            self.lock()
                .log(&client, op_id, collection, LogEvent::ReplyLost);
            return (
                op_id,
                Err(io_error(
                    std::io::ErrorKind::ConnectionReset,
                    "connection reset (model: reply lost)",
                )),
            );
        }
        (op_id, result)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_on_server(
        &self,
        op_id: u64,
        collection: &str,
        request: &Request,
        wire: &str,
        max_time: Option<Duration>,
        arrived: Instant,
        latency: Duration,
        error: bool,
        faults: &Faults,
        txn: Option<u64>,
        wce: &mut Option<(Document, Option<Vec<String>>)>,
    ) -> Result<Response, MongoError> {
        // A retried write whose first run was applied: its recorded result (with no write
        // concern error of its own).
        if let Some(t) = txn
            && let Some(reply) = self.lock().txns.get(&t).cloned()
        {
            *wce = None;
            return Ok(Response::Reply(reply));
        }
        // The test failpoints, as `configureFailPoint` set them.
        let (fail, always_timeout) = {
            let mut s = self.lock();
            let fail = if wire == "configureFailPoint" {
                None
            } else {
                s.trigger_fail_command(wire)
            };
            let always = max_time.is_some() && s.trigger_max_time_always();
            (fail, always)
        };
        if let Some(data) = fail {
            if let Ok(w) = data.get_document("writeConcernError") {
                let labels = data.get_array("errorLabels").ok().map(|a| {
                    a.iter()
                        .filter_map(|l| l.as_str().map(str::to_string))
                        .collect()
                });
                *wce = Some((w.clone(), labels));
            }
            if data.get_bool("blockConnection").unwrap_or(false) {
                let ms = data
                    .get("blockTimeMS")
                    .and_then(num)
                    .map_or(0, |n| match n {
                        Num::I(i) => i.max(0) as u64,
                        Num::F(f) => f.max(0.0) as u64,
                    });
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            if data.get_bool("closeConnection").unwrap_or(false) {
                return Err(io_error(
                    std::io::ErrorKind::ConnectionReset,
                    "connection closed (failCommand)",
                ));
            }
            if let Some(code) = data.get("errorCode").and_then(num) {
                let code = match code {
                    Num::I(i) => i as i32,
                    Num::F(f) => f as i32,
                };
                return Err(command_error(
                    code,
                    "FailPoint",
                    "Failing command via 'failCommand' failpoint",
                ));
            }
        }
        if always_timeout {
            self.lock().counters.killed_max_time += 1;
            return Err(max_time_expired());
        }
        // The run's own time, bounded by maxTimeMS.
        if let Some(limit) = max_time {
            let deadline = arrived + limit;
            if Instant::now() + latency > deadline {
                tokio::time::sleep_until(deadline.max(Instant::now())).await;
                self.lock().counters.killed_max_time += 1;
                return Err(max_time_expired());
            }
        }
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if error {
            return Err(command_error(
                faults.error_code,
                "ModelFault",
                "injected by the model",
            ));
        }
        if is_write(request) && !self.is_primary() {
            return Err(not_primary());
        }
        match request {
            Request::Op(op) => {
                let reply = match self.execute(op_id, collection, op, arrived, faults).await {
                    // The statements of update, delete and insert report their errors as
                    // write errors; findAndModify, as a command error.
                    Err(e)
                        if matches!(
                            op,
                            Op::Update { .. }
                                | Op::Replace { .. }
                                | Op::Delete { .. }
                                | Op::Insert { .. }
                        ) =>
                    {
                        Err(as_write_error(e))
                    }
                    other => other,
                }?;
                if let Some(t) = txn {
                    self.lock().txns.insert(t, reply.clone());
                }
                Ok(Response::Reply(reply))
            }
            Request::Command(c) => {
                let reply = self.lock().command(&self.inner, c);
                reply.map(Response::Command)
            }
            Request::Watch(pipeline) => {
                self.open_stream(collection, pipeline).map(Response::Stream)
            }
        }
    }

    async fn execute(
        &self,
        op_id: u64,
        collection: &str,
        op: &Op,
        arrived: Instant,
        faults: &Faults,
    ) -> Result<Reply, MongoError> {
        let client = self.client.to_string();
        match op {
            Op::Update {
                filter,
                update,
                many: true,
                upsert,
            } => {
                let expr = parse_filter(filter)?;
                // Validate the update before touching anything.
                apply_update(&Document::new(), update, false)?;
                let mut written = Written::default();
                let seqs = self.lock().seqs(collection);
                for seq in seqs {
                    let matched_now = self.lock().matches_seq(collection, seq, &expr);
                    if !matched_now {
                        continue;
                    }
                    if written.matched > 0 {
                        self.between_documents(faults).await;
                    }
                    let mut s = self.lock();
                    if s.stepdown_since(arrived) {
                        return Err(command_error(
                            11602,
                            "InterruptedDueToReplStateChange",
                            "operation was interrupted",
                        ));
                    }
                    // Atomic per document: the filter again, then the update.
                    if !s.matches_seq(collection, seq, &expr) {
                        continue;
                    }
                    written.matched += 1;
                    if s.update_seq(&self.inner, &client, op_id, collection, seq, update)? {
                        written.modified += 1;
                    }
                }
                if written.matched == 0 && *upsert {
                    let mut s = self.lock();
                    let id = s.upsert(&self.inner, &client, op_id, collection, filter, update)?;
                    written.upserted_id = Some(id);
                }
                Ok(Reply::Written(written))
            }
            Op::Delete { filter, many: true } => {
                let expr = parse_filter(filter)?;
                let mut written = Written::default();
                let seqs = self.lock().seqs(collection);
                for seq in seqs {
                    if !self.lock().matches_seq(collection, seq, &expr) {
                        continue;
                    }
                    if written.deleted > 0 {
                        self.between_documents(faults).await;
                    }
                    let mut s = self.lock();
                    if s.stepdown_since(arrived) {
                        return Err(command_error(
                            11602,
                            "InterruptedDueToReplStateChange",
                            "operation was interrupted",
                        ));
                    }
                    if !s.matches_seq(collection, seq, &expr) {
                        continue;
                    }
                    s.delete_seq(&self.inner, &client, op_id, collection, seq);
                    written.deleted += 1;
                }
                Ok(Reply::Written(written))
            }
            Op::Insert { docs, ordered } if docs.len() > 1 => {
                let mut written = Written::default();
                let mut errors = Vec::new();
                for (i, d) in docs.iter().enumerate() {
                    if i > 0 {
                        self.between_documents(faults).await;
                    }
                    let mut s = self.lock();
                    if s.stepdown_since(arrived) {
                        return Err(command_error(
                            11602,
                            "InterruptedDueToReplStateChange",
                            "operation was interrupted",
                        ));
                    }
                    match s.insert_one(&self.inner, &client, op_id, collection, d.clone()) {
                        Ok(()) => written.inserted += 1,
                        Err(e) => {
                            let (code, message) = match *e.kind {
                                mongodb::error::ErrorKind::Write(
                                    mongodb::error::WriteFailure::WriteError(ref w),
                                ) => (w.code, w.message.clone()),
                                _ => (2, e.to_string()),
                            };
                            errors
                                .push(doc! { "index": i as i64, "code": code, "errmsg": message });
                            if *ordered {
                                break;
                            }
                        }
                    }
                }
                if errors.is_empty() {
                    Ok(Reply::Written(written))
                } else {
                    Err(insert_many_error(errors))
                }
            }
            other => {
                let mut s = self.lock();
                s.execute_atomic(&self.inner, &client, op_id, collection, other)
            }
        }
    }

    async fn between_documents(&self, faults: &Faults) {
        let Some(latency) = faults.per_document else {
            return;
        };
        let d = self.lock().rng.delay(latency);
        if d.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(d).await;
        }
    }

    fn open_stream(
        &self,
        collection: &str,
        pipeline: &[Document],
    ) -> Result<ChangeStream, MongoError> {
        let mut filters = Vec::new();
        for stage in pipeline {
            match stage.get("$match") {
                Some(Bson::Document(m)) if stage.len() == 1 => filters.push(parse_filter(m)?),
                _ => {
                    return Err(bad_value(
                        "the model's change streams take only $match stages",
                    ));
                }
            }
        }
        let rx = self.inner.events.subscribe();
        let coll = collection.to_string();
        let stream = futures::stream::unfold(Some(rx), move |rx| {
            let filters = filters.clone();
            let coll = coll.clone();
            async move {
                let mut rx = rx?;
                // A read answers within AWAIT, with nothing new if nothing matched (a
                // `getMore` under `maxAwaitTimeMS`).
                let quiet = tokio::time::sleep(AWAIT);
                tokio::pin!(quiet);
                loop {
                    let received = tokio::select! {
                        biased;
                        r = rx.recv() => r,
                        _ = &mut quiet => return Some((Ok(None), Some(rx))),
                    };
                    match received {
                        Ok(Broadcast::Event(c, event)) => {
                            if c == coll && filters.iter().all(|f| matches(f, &event)) {
                                return Some((Ok(Some(event)), Some(rx)));
                            }
                        }
                        Ok(Broadcast::Cut) => {
                            return Some((
                                Err(io_error(
                                    std::io::ErrorKind::ConnectionReset,
                                    "change stream cut (model)",
                                )),
                                None,
                            ));
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            return Some((
                                Err(command_error(
                                    286,
                                    "ChangeStreamHistoryLost",
                                    "the change stream fell behind (model)",
                                )),
                                None,
                            ));
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            }
        });
        Ok(stream.boxed())
    }
}

impl State {
    fn next_op_id(&mut self) -> u64 {
        self.next_op += 1;
        self.next_op
    }

    fn log(&mut self, client: &str, op_id: u64, collection: &str, event: LogEvent) {
        if !self.keep_log {
            return;
        }
        self.log_seq += 1;
        let at = Instant::now();
        self.log.push(LogEntry {
            seq: self.log_seq,
            op_id,
            client: client.to_string(),
            collection: collection.to_string(),
            at,
            server_ms: self.clock.at(at),
            event,
        });
    }

    fn stepdown_since(&self, arrived: Instant) -> bool {
        // A stepdown that began after the operation arrived interrupts it.
        self.stepdown_until
            .is_some_and(|until| Instant::now() < until)
            && Instant::now() >= arrived
    }

    fn trigger_fail_command(&mut self, wire: &str) -> Option<Document> {
        let fp = self.fail_command.as_mut()?;
        let names = fp.data.get_array("failCommands").ok()?;
        if !names.iter().any(|n| n.as_str() == Some(wire)) {
            return None;
        }
        let data = fp.data.clone();
        match fp.remaining.as_mut() {
            None => {}
            Some(0) => {
                self.fail_command = None;
                return None;
            }
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    self.fail_command = None;
                }
            }
        }
        Some(data)
    }

    fn trigger_max_time_always(&mut self) -> bool {
        let Some(fp) = self.max_time_always.as_mut() else {
            return false;
        };
        match fp.remaining.as_mut() {
            None => true,
            Some(n) => {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.max_time_always = None;
                }
                true
            }
        }
    }

    fn coll_mut(&mut self, name: &str) -> &mut Collection {
        self.colls
            .entry(name.to_string())
            .or_insert_with(Collection::with_id_index)
    }

    fn seqs(&self, collection: &str) -> Vec<u64> {
        self.colls
            .get(collection)
            .map(|c| c.docs.keys().copied().collect())
            .unwrap_or_default()
    }

    fn matches_seq(&self, collection: &str, seq: u64, expr: &Expr) -> bool {
        self.colls
            .get(collection)
            .and_then(|c| c.docs.get(&seq))
            .is_some_and(|d| matches(expr, d))
    }

    fn matching(&self, collection: &str, expr: &Expr) -> Vec<(u64, Document)> {
        self.colls
            .get(collection)
            .map(|c| {
                c.docs
                    .iter()
                    .filter(|(_, d)| matches(expr, d))
                    .map(|(s, d)| (*s, d.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn emit(
        &mut self,
        inner: &Inner,
        collection: &str,
        kind: &str,
        id: &Bson,
        full: Option<&Document>,
        before: Option<&Document>,
    ) {
        self.event_seq += 1;
        let now = Instant::now();
        let mut event = doc! {
            "_id": { "_data": format!("{:016x}", self.event_seq) },
            "operationType": kind,
            "clusterTime": Bson::Timestamp(bson::Timestamp { time: (self.clock.at(now) / 1000).max(0) as u32, increment: self.event_seq as u32 }),
            "wallTime": DateTime::from_millis(self.clock.at(now)),
            "ns": { "db": inner.db.clone(), "coll": collection },
            "documentKey": { "_id": id.clone() },
        };
        match (kind, full) {
            ("insert" | "replace", Some(d)) => {
                event.insert("fullDocument", d.clone());
            }
            ("update", Some(after)) => {
                let mut updated = Document::new();
                let mut removed = Vec::new();
                for (k, v) in after {
                    if before
                        .and_then(|b| b.get(k))
                        .is_none_or(|old| !same_value(old, v))
                    {
                        updated.insert(k.clone(), v.clone());
                    }
                }
                if let Some(b) = before {
                    for k in b.keys() {
                        if !after.contains_key(k) {
                            removed.push(Bson::String(k.clone()));
                        }
                    }
                }
                event.insert(
                    "updateDescription",
                    doc! { "updatedFields": updated, "removedFields": removed },
                );
            }
            _ => {}
        }
        let _ = inner
            .events
            .send(Broadcast::Event(collection.to_string(), event));
    }

    fn new_object_id(&mut self) -> ObjectId {
        self.next_oid += 1;
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&0x6000_0000u32.to_be_bytes());
        bytes[4..].copy_from_slice(&self.next_oid.to_be_bytes());
        ObjectId::from_bytes(bytes)
    }

    fn insert_one(
        &mut self,
        inner: &Inner,
        client: &str,
        op_id: u64,
        collection: &str,
        doc: Document,
    ) -> Result<(), MongoError> {
        let doc = match doc.get("_id") {
            Some(Bson::Array(_)) => {
                return Err(write_error(2, "BadValue", "can't use an array for _id"));
            }
            Some(_) => doc,
            None => {
                let id = Bson::ObjectId(self.new_object_id());
                id_first(doc, id)
            }
        };
        let id = doc.get("_id").cloned().unwrap_or(Bson::Null);
        let key = id_key(&id);
        let db = inner.db.clone();
        self.next_seq += 1;
        let seq = self.next_seq;
        let c = self.coll_mut(collection);
        if c.by_id.contains_key(&key) {
            return Err(write_error(
                11000,
                "DuplicateKey",
                &format!(
                    "E11000 duplicate key error collection: {db}.{collection} index: _id_ dup key: {{ _id: {id} }}"
                ),
            ));
        }
        c.by_id.insert(key, seq);
        c.docs.insert(seq, doc.clone());
        self.counters.inserted += 1;
        self.log(
            client,
            op_id,
            collection,
            LogEvent::Wrote {
                id: id.clone(),
                before: None,
                after: Some(doc.clone()),
            },
        );
        self.emit(inner, collection, "insert", &id, Some(&doc), None);
        Ok(())
    }

    /// Applies `update` to one stored document; whether it changed.
    fn update_seq(
        &mut self,
        inner: &Inner,
        client: &str,
        op_id: u64,
        collection: &str,
        seq: u64,
        update: &Document,
    ) -> Result<bool, MongoError> {
        let Some(before) = self
            .colls
            .get(collection)
            .and_then(|c| c.docs.get(&seq))
            .cloned()
        else {
            return Ok(false);
        };
        let after = apply_update(&before, update, false)?;
        self.store_after(
            inner, client, op_id, collection, seq, before, after, "update",
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn store_after(
        &mut self,
        inner: &Inner,
        client: &str,
        op_id: u64,
        collection: &str,
        seq: u64,
        before: Document,
        after: Document,
        kind: &str,
    ) -> Result<bool, MongoError> {
        if same_bytes(&before, &after) {
            return Ok(false);
        }
        let id = after.get("_id").cloned().unwrap_or(Bson::Null);
        if let Some(c) = self.colls.get_mut(collection) {
            c.docs.insert(seq, after.clone());
        }
        self.counters.updated += 1;
        self.log(
            client,
            op_id,
            collection,
            LogEvent::Wrote {
                id: id.clone(),
                before: Some(before.clone()),
                after: Some(after.clone()),
            },
        );
        self.emit(inner, collection, kind, &id, Some(&after), Some(&before));
        Ok(true)
    }

    fn delete_seq(&mut self, inner: &Inner, client: &str, op_id: u64, collection: &str, seq: u64) {
        let Some(c) = self.colls.get_mut(collection) else {
            return;
        };
        let Some(before) = c.docs.remove(&seq) else {
            return;
        };
        let id = before.get("_id").cloned().unwrap_or(Bson::Null);
        c.by_id.remove(&id_key(&id));
        self.counters.deleted += 1;
        self.log(
            client,
            op_id,
            collection,
            LogEvent::Wrote {
                id: id.clone(),
                before: Some(before),
                after: None,
            },
        );
        self.emit(inner, collection, "delete", &id, None, None);
    }

    fn upsert(
        &mut self,
        inner: &Inner,
        client: &str,
        op_id: u64,
        collection: &str,
        filter: &Document,
        update: &Document,
    ) -> Result<Bson, MongoError> {
        let seed = upsert_seed(filter)?;
        let mut doc = apply_update(&seed, update, true)?;
        let id = match doc.get("_id") {
            Some(id) => id.clone(),
            None => Bson::ObjectId(self.new_object_id()),
        };
        doc = id_first(doc, id.clone());
        self.insert_one(inner, client, op_id, collection, doc)?;
        Ok(id)
    }

    fn execute_atomic(
        &mut self,
        inner: &Inner,
        client: &str,
        op_id: u64,
        collection: &str,
        op: &Op,
    ) -> Result<Reply, MongoError> {
        match op {
            Op::Find {
                filter,
                projection,
                sort,
                limit,
                ..
            } => {
                let expr = parse_filter(filter)?;
                let keys = sort
                    .as_ref()
                    .map(parse_sort)
                    .transpose()?
                    .unwrap_or_default();
                let mut docs: Vec<Document> = self
                    .matching(collection, &expr)
                    .into_iter()
                    .map(|(_, d)| d)
                    .collect();
                sort_docs(&mut docs, &keys);
                if let Some(l) = limit.filter(|l| *l != 0) {
                    docs.truncate(l.unsigned_abs() as usize);
                }
                let ids: Vec<Bson> = docs.iter().filter_map(|d| d.get("_id").cloned()).collect();
                self.log(client, op_id, collection, LogEvent::Read { ids });
                if let Some(p) = projection {
                    docs = docs
                        .iter()
                        .map(|d| project(d, p))
                        .collect::<Result<_, _>>()?;
                }
                self.counters.returned += docs.len() as u64;
                Ok(Reply::Docs(docs))
            }
            Op::Count { filter, limit, .. } => {
                let expr = parse_filter(filter)?;
                let n = self.matching(collection, &expr).len() as u64;
                Ok(Reply::Count(match limit {
                    Some(l) if *l > 0 => n.min(*l),
                    _ => n,
                }))
            }
            Op::Distinct { field, filter, .. } => {
                let expr = parse_filter(filter)?;
                let mut values: Vec<Bson> = Vec::new();
                for (_, d) in self.matching(collection, &expr) {
                    for v in path_values(&d, field).into_iter().flatten() {
                        let items: Vec<&Bson> = match v {
                            Bson::Array(items) => items.iter().collect(),
                            other => vec![other],
                        };
                        for item in items {
                            if !values.iter().any(|x| equal(x, item)) {
                                values.push(item.clone());
                            }
                        }
                    }
                }
                values.sort_by(compare);
                Ok(Reply::Values(values))
            }
            Op::Update {
                filter,
                update,
                many: false,
                upsert,
            } => {
                let expr = parse_filter(filter)?;
                let first = self.matching(collection, &expr).into_iter().next();
                let mut written = Written::default();
                match first {
                    Some((seq, _)) => {
                        written.matched = 1;
                        if self.update_seq(inner, client, op_id, collection, seq, update)? {
                            written.modified = 1;
                        }
                    }
                    None if *upsert => {
                        // Validate first, as the server rejects a bad update whether or not it matches.
                        written.upserted_id =
                            Some(self.upsert(inner, client, op_id, collection, filter, update)?);
                    }
                    None => {
                        apply_update(&Document::new(), update, false)?;
                    }
                }
                Ok(Reply::Written(written))
            }
            Op::Update { .. } | Op::Delete { many: true, .. } => {
                Err(bad_value("model: multi-document write outside its path"))
            }
            Op::Replace {
                filter,
                replacement,
                upsert,
            } => {
                if replacement.keys().any(|k| k.starts_with('$')) {
                    return Err(bad_value(
                        "the replacement document must not contain update operators",
                    ));
                }
                let expr = parse_filter(filter)?;
                let first = self.matching(collection, &expr).into_iter().next();
                let mut written = Written::default();
                match first {
                    Some((seq, before)) => {
                        written.matched = 1;
                        let id = before.get("_id").cloned().unwrap_or(Bson::Null);
                        if let Some(new_id) = replacement.get("_id")
                            && !same_value(new_id, &id)
                        {
                            return Err(immutable_id());
                        }
                        let after = id_first(replacement.clone(), id);
                        if self.store_after(
                            inner, client, op_id, collection, seq, before, after, "replace",
                        )? {
                            written.modified = 1;
                        }
                    }
                    None if *upsert => {
                        let seed = upsert_seed(filter)?;
                        let id = match (replacement.get("_id"), seed.get("_id")) {
                            (Some(id), _) | (None, Some(id)) => id.clone(),
                            (None, None) => Bson::ObjectId(self.new_object_id()),
                        };
                        self.insert_one(
                            inner,
                            client,
                            op_id,
                            collection,
                            id_first(replacement.clone(), id.clone()),
                        )?;
                        written.upserted_id = Some(id);
                    }
                    None => {}
                }
                Ok(Reply::Written(written))
            }
            Op::FindOneAndUpdate {
                filter,
                update,
                sort,
                upsert,
                return_new,
                ..
            } => {
                let expr = parse_filter(filter)?;
                let keys = sort
                    .as_ref()
                    .map(parse_sort)
                    .transpose()?
                    .unwrap_or_default();
                let mut found = self.matching(collection, &expr);
                if !keys.is_empty() {
                    let mut docs: Vec<Document> = found.iter().map(|(_, d)| d.clone()).collect();
                    sort_docs(&mut docs, &keys);
                    let first_id = docs.first().and_then(|d| d.get("_id")).map(id_key);
                    found.retain(|(_, d)| d.get("_id").map(id_key) == first_id);
                }
                match found.into_iter().next() {
                    Some((seq, before)) => {
                        self.update_seq(inner, client, op_id, collection, seq, update)?;
                        let after = self
                            .colls
                            .get(collection)
                            .and_then(|c| c.docs.get(&seq))
                            .cloned();
                        let id = before.get("_id").cloned().unwrap_or(Bson::Null);
                        self.log(client, op_id, collection, LogEvent::Read { ids: vec![id] });
                        Ok(Reply::Doc(if *return_new { after } else { Some(before) }))
                    }
                    None if *upsert => {
                        let id = self.upsert(inner, client, op_id, collection, filter, update)?;
                        let after = self
                            .colls
                            .get(collection)
                            .and_then(|c| c.by_id.get(&id_key(&id)).and_then(|s| c.docs.get(s)))
                            .cloned();
                        Ok(Reply::Doc(if *return_new { after } else { None }))
                    }
                    None => {
                        apply_update(&Document::new(), update, false)?;
                        Ok(Reply::Doc(None))
                    }
                }
            }
            Op::Delete {
                filter,
                many: false,
            } => {
                let expr = parse_filter(filter)?;
                let first = self.matching(collection, &expr).into_iter().next();
                let mut written = Written::default();
                if let Some((seq, _)) = first {
                    self.delete_seq(inner, client, op_id, collection, seq);
                    written.deleted = 1;
                }
                Ok(Reply::Written(written))
            }
            Op::Insert { docs, .. } => {
                let mut written = Written::default();
                for d in docs {
                    self.insert_one(inner, client, op_id, collection, d.clone())?;
                    written.inserted += 1;
                }
                Ok(Reply::Written(written))
            }
        }
    }

    // -- commands -----------------------------------------------------------------------------

    fn command(&mut self, inner: &Inner, c: &Document) -> Result<Document, MongoError> {
        let name = c.keys().next().cloned().unwrap_or_default();
        let target = c.get_str(&name).unwrap_or("").to_string();
        let now = Instant::now();
        let local = DateTime::from_millis(self.clock.at(now));
        match name.as_str() {
            "hello" | "isMaster" | "ismaster" => {
                let primary = self.stepdown_until.is_none_or(|t| now >= t);
                let mut reply = doc! {
                    "helloOk": true,
                    "isWritablePrimary": primary,
                    "ismaster": primary,
                    "secondary": !primary,
                    "maxBsonObjectSize": 16_777_216,
                    "maxMessageSizeBytes": 48_000_000,
                    "maxWriteBatchSize": 100_000,
                    "localTime": local,
                    "logicalSessionTimeoutMinutes": 30,
                    "minWireVersion": 0,
                    "maxWireVersion": 21,
                    "readOnly": false,
                };
                if let Some(set) = &self.set_name {
                    reply.insert("setName", set.clone());
                }
                reply.insert("ok", 1.0);
                Ok(reply)
            }
            "ping" => Ok(doc! { "ok": 1.0 }),
            "buildInfo" | "buildinfo" => Ok(doc! {
                "version": "7.0.0-model",
                "versionArray": [7, 0, 0, 0],
                "maxBsonObjectSize": 16_777_216,
                "ok": 1.0,
            }),
            "serverStatus" => {
                let mut commands = Document::new();
                for (k, (total, failed)) in &self.counters.commands {
                    commands.insert(
                        k.clone(),
                        doc! { "total": *total as i64, "failed": *failed as i64 },
                    );
                }
                Ok(doc! {
                    "host": "model",
                    "version": "7.0.0-model",
                    "uptime": now.saturating_duration_since(self.started).as_secs_f64(),
                    "localTime": local,
                    "metrics": {
                        "commands": commands,
                        "document": {
                            "returned": self.counters.returned as i64,
                            "inserted": self.counters.inserted as i64,
                            "updated": self.counters.updated as i64,
                            "deleted": self.counters.deleted as i64,
                        },
                        "operation": { "killedDueToMaxTimeMSExpired": self.counters.killed_max_time as i64 },
                    },
                    "ok": 1.0,
                })
            }
            "createIndexes" => {
                let Ok(specs) = c.get_array("indexes") else {
                    return Err(failed_to_parse("createIndexes needs indexes"));
                };
                let existed = self.colls.contains_key(&target);
                let coll = self.coll_mut(&target);
                let before = coll.indexes.len() as i32;
                for spec in specs {
                    let Bson::Document(spec) = spec else {
                        return Err(failed_to_parse("index specification must be an object"));
                    };
                    let (Ok(key), Ok(iname)) = (spec.get_document("key"), spec.get_str("name"))
                    else {
                        return Err(failed_to_parse("index specification needs key and name"));
                    };
                    let mut stored = doc! { "v": 2, "key": key.clone(), "name": iname };
                    for (k, v) in spec {
                        if k != "key" && k != "name" && k != "v" {
                            stored.insert(k.clone(), v.clone());
                        }
                    }
                    if let Some(same_name) =
                        coll.indexes.iter().find(|i| i.get_str("name") == Ok(iname))
                    {
                        if same_name.get_document("key").ok() != Some(key) {
                            return Err(command_error(
                                86,
                                "IndexKeySpecsConflict",
                                &format!(
                                    "An existing index has the same name as the requested index: {iname}"
                                ),
                            ));
                        }
                        if !same_bytes(same_name, &stored) {
                            return Err(command_error(
                                85,
                                "IndexOptionsConflict",
                                &format!(
                                    "An index with the same name but different options exists: {iname}"
                                ),
                            ));
                        }
                        continue;
                    }
                    if let Some(same_key) = coll
                        .indexes
                        .iter()
                        .find(|i| i.get_document("key").ok() == Some(key))
                    {
                        let other = same_key.get_str("name").unwrap_or("").to_string();
                        return Err(command_error(
                            85,
                            "IndexOptionsConflict",
                            &format!("Index already exists with a different name: {other}"),
                        ));
                    }
                    coll.indexes.push(stored);
                }
                let after = coll.indexes.len() as i32;
                Ok(doc! {
                    "numIndexesBefore": before,
                    "numIndexesAfter": after,
                    "createdCollectionAutomatically": !existed,
                    "ok": 1.0,
                })
            }
            "listIndexes" => {
                let Some(coll) = self.colls.get(&target) else {
                    return Err(command_error(
                        26,
                        "NamespaceNotFound",
                        &format!("ns does not exist: {}.{target}", inner.db),
                    ));
                };
                Ok(doc! {
                    "cursor": {
                        "id": 0_i64,
                        "ns": format!("{}.{target}", inner.db),
                        "firstBatch": coll.indexes.iter().cloned().map(Bson::Document).collect::<Vec<_>>(),
                    },
                    "ok": 1.0,
                })
            }
            "dropIndexes" | "deleteIndexes" => {
                let Some(coll) = self.colls.get_mut(&target) else {
                    return Err(command_error(
                        26,
                        "NamespaceNotFound",
                        &format!("ns not found {}.{target}", inner.db),
                    ));
                };
                let was = coll.indexes.len() as i32;
                match c.get("index") {
                    Some(Bson::String(n)) if n == "*" => coll.indexes.truncate(1),
                    Some(Bson::String(n)) if n == "_id_" => {
                        return Err(command_error(72, "InvalidOptions", "cannot drop _id index"));
                    }
                    Some(Bson::String(n)) => {
                        let Some(i) = coll
                            .indexes
                            .iter()
                            .position(|x| x.get_str("name") == Ok(n.as_str()))
                        else {
                            return Err(command_error(
                                27,
                                "IndexNotFound",
                                &format!("index not found with name [{n}]"),
                            ));
                        };
                        coll.indexes.remove(i);
                    }
                    Some(Bson::Document(key)) => {
                        let Some(i) = coll
                            .indexes
                            .iter()
                            .position(|x| x.get_document("key").ok() == Some(key))
                        else {
                            return Err(command_error(
                                27,
                                "IndexNotFound",
                                "can't find index with key",
                            ));
                        };
                        coll.indexes.remove(i);
                    }
                    _ => return Err(failed_to_parse("dropIndexes needs index")),
                }
                Ok(doc! { "nIndexesWas": was, "ok": 1.0 })
            }
            "collMod" => {
                let Some(coll) = self.colls.get_mut(&target) else {
                    return Err(command_error(
                        26,
                        "NamespaceNotFound",
                        &format!("ns does not exist: {}.{target}", inner.db),
                    ));
                };
                let Ok(index) = c.get_document("index") else {
                    return Ok(doc! { "ok": 1.0 });
                };
                let found = match index.get("name") {
                    Some(Bson::String(n)) => coll
                        .indexes
                        .iter_mut()
                        .find(|x| x.get_str("name") == Ok(n.as_str())),
                    _ => match index.get_document("keyPattern") {
                        Ok(k) => coll
                            .indexes
                            .iter_mut()
                            .find(|x| x.get_document("key").ok() == Some(k)),
                        Err(_) => None,
                    },
                };
                let Some(spec) = found else {
                    return Err(command_error(
                        27,
                        "IndexNotFound",
                        "cannot find index for collMod",
                    ));
                };
                let mut reply = Document::new();
                if let Some(secs) = index.get("expireAfterSeconds") {
                    let Some(old) = spec.get("expireAfterSeconds").cloned() else {
                        return Err(command_error(
                            2,
                            "BadValue",
                            "no expireAfterSeconds field to update",
                        ));
                    };
                    reply.insert("expireAfterSeconds_old", old);
                    reply.insert("expireAfterSeconds_new", secs.clone());
                    spec.insert("expireAfterSeconds", secs.clone());
                }
                reply.insert("ok", 1.0);
                Ok(reply)
            }
            "drop" => {
                if self.colls.remove(&target).is_none() {
                    return Err(command_error(26, "NamespaceNotFound", "ns not found"));
                }
                Ok(doc! { "ns": format!("{}.{target}", inner.db), "ok": 1.0 })
            }
            "dropDatabase" => {
                self.colls.clear();
                Ok(doc! { "ok": 1.0 })
            }
            "configureFailPoint" => {
                let mode = c.get("mode").cloned().unwrap_or(Bson::Null);
                let fp = match &mode {
                    Bson::String(m) if m == "off" => None,
                    Bson::String(m) if m == "alwaysOn" => Some(FailPoint {
                        remaining: None,
                        data: c.get_document("data").cloned().unwrap_or_default(),
                    }),
                    Bson::Document(m) => match m.get("times").and_then(num) {
                        Some(Num::I(n)) if n > 0 => Some(FailPoint {
                            remaining: Some(n as u64),
                            data: c.get_document("data").cloned().unwrap_or_default(),
                        }),
                        _ => {
                            return Err(bad_value(
                                "the model takes mode off, alwaysOn or {times: n}",
                            ));
                        }
                    },
                    _ => {
                        return Err(bad_value(
                            "the model takes mode off, alwaysOn or {times: n}",
                        ));
                    }
                };
                match target.as_str() {
                    "failCommand" => self.fail_command = fp,
                    "maxTimeAlwaysTimeOut" => self.max_time_always = fp,
                    other => return Err(bad_value(&format!("the model has no failpoint {other}"))),
                }
                Ok(doc! { "count": 0, "ok": 1.0 })
            }
            "replSetStepDown" => {
                let secs = c.get(&name).and_then(num).map_or(60, |n| match n {
                    Num::I(i) => i.max(0) as u64,
                    Num::F(f) => f.max(0.0) as u64,
                });
                self.stepdown_until = Some(now + Duration::from_secs(secs));
                Ok(doc! { "ok": 1.0 })
            }
            other => Err(command_error(
                59,
                "CommandNotFound",
                &format!("no such command: '{other}'"),
            )),
        }
    }
}

impl MongoModel {
    /// Server selection: waits (up to the driver's timeout) for the server to be reachable by
    /// this client and primary, when this client last saw it otherwise.
    async fn select(&self) -> Result<(), MongoError> {
        let client = self.client.to_string();
        let (known, timeout) = {
            let s = self.lock();
            (!s.unknown.contains(&client), s.driver.server_selection)
        };
        if known {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let blocked_until = {
                let s = self.lock();
                let now = Instant::now();
                [
                    s.cut_until.get(&client),
                    s.cut_until.get(""),
                    s.stepdown_until.as_ref(),
                ]
                .into_iter()
                .flatten()
                .filter(|t| **t > now)
                .max()
                .copied()
            };
            match blocked_until {
                None => {
                    self.lock().unknown.remove(&client);
                    return Ok(());
                }
                Some(t) if t <= deadline => tokio::time::sleep_until(t).await,
                Some(_) => {
                    tokio::time::sleep_until(deadline).await;
                    return Err(MongoError::custom(format!(
                        "Server selection timeout: no available servers (model, {timeout:?})"
                    )));
                }
            }
        }
    }

    async fn attempt(
        &self,
        collection: &str,
        op: &Op,
        txn: Option<u64>,
    ) -> Result<Reply, MongoError> {
        let out = match self
            .submit(collection.to_string(), Request::Op(op.clone()), txn)
            .await
        {
            Ok(Ok(Response::Reply(r))) => Ok(r),
            Ok(Ok(_)) => Err(MongoError::custom("model: unexpected response")),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io_error(
                std::io::ErrorKind::BrokenPipe,
                "model: the server task ended",
            )),
        };
        if let Err(e) = &out
            && marks_unknown(e)
        {
            self.lock().unknown.insert(self.client.to_string());
        }
        out
    }

    /// One operation as the driver runs it: selection, the attempt, and one retry.
    async fn drive(&self, collection: String, op: Op) -> Result<Reply, MongoError> {
        // The driver's own checks, before anything is sent.
        match &op {
            Op::Update { update, .. } | Op::FindOneAndUpdate { update, .. }
                if !update.keys().next().is_some_and(|k| k.starts_with('$')) =>
            {
                return Err(MongoError::custom(
                    "update document must have first key starting with '$' (model: the driver's check)",
                ));
            }
            Op::Replace { replacement, .. }
                if replacement
                    .keys()
                    .next()
                    .is_some_and(|k| k.starts_with('$')) =>
            {
                return Err(MongoError::custom(
                    "replacement document must not contain update modifiers (model: the driver's check)",
                ));
            }
            _ => {}
        }
        let driver = self.lock().driver;
        if !driver.retries {
            return self.attempt(&collection, &op, None).await;
        }
        self.select().await?;
        let retryable = retryable_op(&op);
        let txn = (retryable && !is_read(&op)).then(|| {
            let mut s = self.lock();
            s.next_txn += 1;
            s.next_txn
        });
        match self.attempt(&collection, &op, txn).await {
            Err(e) if retryable && retryable_error(&e) => {
                if self.select().await.is_err() {
                    return Err(e);
                }
                self.attempt(&collection, &op, txn).await
            }
            other => other,
        }
    }
}

impl Backend for MongoModel {
    fn run(&self, collection: &str, op: Op) -> BoxFuture<'static, Result<Reply, MongoError>> {
        let (me, collection) = (self.clone(), collection.to_string());
        Box::pin(async move { me.drive(collection, op).await })
    }

    fn command(&self, command: Document) -> BoxFuture<'static, Result<Document, MongoError>> {
        let me = self.clone();
        Box::pin(async move {
            match me
                .submit(String::new(), Request::Command(command), None)
                .await
            {
                Ok(Ok(Response::Command(d))) => Ok(d),
                Ok(Ok(_)) => Err(MongoError::custom("model: unexpected response")),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(io_error(
                    std::io::ErrorKind::BrokenPipe,
                    "model: the server task ended",
                )),
            }
        })
    }

    fn watch(
        &self,
        collection: &str,
        pipeline: Vec<Document>,
    ) -> BoxFuture<'static, Result<ChangeStream, MongoError>> {
        let (me, collection) = (self.clone(), collection.to_string());
        Box::pin(async move {
            match me.submit(collection, Request::Watch(pipeline), None).await {
                Ok(Ok(Response::Stream(s))) => Ok(s),
                Ok(Ok(_)) => Err(MongoError::custom("model: unexpected response")),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(io_error(
                    std::io::ErrorKind::BrokenPipe,
                    "model: the server task ended",
                )),
            }
        })
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}
