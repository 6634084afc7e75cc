//! Hostile `Timeouts` documents, generated from bytes (structure-aware fuzzing): every BSON
//! type in every field and every header, dates across the whole BSON range, strings and keys
//! longer than AMQP's limits, headers larger than a frame, nested documents, ids of every
//! representation. Used by the fuzz target (`fuzz/fuzz_targets/hostile_record.rs` includes
//! this file), by `tests/suite/hostile.rs` over many seeds, and by the integration test that runs
//! the real daemon among such records.
#![allow(dead_code)]

use arbitrary::{Result, Unstructured};
use bson::spec::BinarySubtype;
use bson::{Binary, Bson, DateTime, Document, oid::ObjectId};

/// .NET ticks at the Unix epoch.
const EPOCH_TICKS: i64 = 621_355_968_000_000_000;

/// A string of `min` to `max` bytes of one repeated (possibly multi-byte) character.
fn long_string(u: &mut Unstructured, min: usize, max: usize) -> Result<String> {
    let len = u.int_in_range(min..=max)?;
    let c = *u.choose(&['x', 'é', '€', '\0', '😀'])?;
    let n = len / c.len_utf8().max(1);
    Ok(std::iter::repeat_n(c, n.max(1)).collect())
}

/// A string: usually short, sometimes at or past 255 bytes, sometimes past a frame.
fn any_string(u: &mut Unstructured) -> Result<String> {
    Ok(match u.int_in_range(0..=9)? {
        0..=5 => short_string(u)?,
        6 => long_string(u, 255, 255)?,
        7 => long_string(u, 256, 400)?,
        8 => long_string(u, 100_000, 160_000)?,
        _ => String::new(),
    })
}

/// Up to 24 arbitrary characters.
fn short_string(u: &mut Unstructured) -> Result<String> {
    let len = u.int_in_range(0..=24)?;
    let mut s = String::new();
    for _ in 0..len {
        s.push(u.arbitrary::<char>()?);
    }
    Ok(s)
}

/// A date anywhere in the BSON range, with the .NET limits and the epoch often chosen.
fn any_date(u: &mut Unstructured) -> Result<DateTime> {
    let ms = match u.int_in_range(0..=7)? {
        0 => -62_135_596_800_000, // 0001-01-01, .NET's DateTime.MinValue
        1 => 253_402_300_799_999, // the last millisecond .NET can hold
        2 => -62_135_596_800_001, // just before
        3 => 253_402_300_800_000, // just after
        4 => *u.choose(&[i64::MIN, i64::MAX, 0, -1])?,
        _ => u.arbitrary::<i64>()?,
    };
    Ok(DateTime::from_millis(ms))
}

/// A binary of any subtype and length (16 bytes often: a UUID of either representation).
fn any_binary(u: &mut Unstructured) -> Result<Binary> {
    let subtype = match u.int_in_range(0..=6)? {
        0 => BinarySubtype::Generic,
        1 => BinarySubtype::UuidOld,
        2 => BinarySubtype::Uuid,
        3 => BinarySubtype::Md5,
        4 => BinarySubtype::UserDefined(0x80),
        5 => BinarySubtype::BinaryOld,
        _ => BinarySubtype::Function,
    };
    let len = if u.ratio(2, 3)? {
        16
    } else {
        u.int_in_range(0..=40)?
    };
    let mut bytes = vec![0u8; len];
    u.fill_buffer(&mut bytes)?;
    // BinaryOld carries its own length prefix; keep it well formed for the encoder.
    if subtype == BinarySubtype::BinaryOld {
        return Ok(Binary {
            subtype: BinarySubtype::Generic,
            bytes,
        });
    }
    Ok(Binary { subtype, bytes })
}

/// A UUID as ServiceConnect stores ids (subtype 4), or as the C# driver's legacy
/// representation does (subtype 3).
fn uuid_binary(u: &mut Unstructured) -> Result<Bson> {
    let mut bytes = [0u8; 16];
    u.fill_buffer(&mut bytes)?;
    let subtype = if u.ratio(1, 4)? {
        BinarySubtype::UuidOld
    } else {
        BinarySubtype::Uuid
    };
    Ok(Bson::Binary(Binary {
        subtype,
        bytes: bytes.to_vec(),
    }))
}

/// Any BSON value, nested up to `depth`.
pub fn any_bson(u: &mut Unstructured, depth: u32) -> Result<Bson> {
    let kinds = if depth == 0 { 15 } else { 17 };
    Ok(match u.int_in_range(0..=kinds)? {
        0 => Bson::String(any_string(u)?),
        1 => Bson::Null,
        2 => Bson::Boolean(u.arbitrary()?),
        3 => Bson::Int32(u.arbitrary()?),
        4 => Bson::Int64(u.arbitrary()?),
        5 => Bson::Double(*u.choose(&[f64::NAN, f64::INFINITY, -0.0, 1e300, 0.1])?),
        6 => Bson::Double(u.arbitrary()?),
        7 => Bson::DateTime(any_date(u)?),
        8 => Bson::Binary(any_binary(u)?),
        9 => uuid_binary(u)?,
        10 => Bson::ObjectId(ObjectId::from_bytes(u.arbitrary()?)),
        11 => Bson::Timestamp(bson::Timestamp {
            time: u.arbitrary()?,
            increment: u.arbitrary()?,
        }),
        12 => Bson::RegularExpression(bson::Regex {
            pattern: "a+".into(),
            options: "i".into(),
        }),
        13 => Bson::Decimal128(bson::Decimal128::from_bytes(u.arbitrary()?)),
        14 => Bson::MinKey,
        15 => Bson::MaxKey,
        16 => Bson::Document(any_document(u, depth - 1)?),
        _ => {
            let n = u.int_in_range(0..=4)?;
            let mut items = Vec::new();
            for _ in 0..n {
                items.push(any_bson(u, depth - 1)?);
            }
            Bson::Array(items)
        }
    })
}

/// A header name: ordinary, reserved, one RabbitMQ reads as routing, empty, dotted, or
/// longer than an AMQP field name.
fn header_key(u: &mut Unstructured) -> Result<String> {
    Ok(match u.int_in_range(0..=6)? {
        0 => (*u.choose(&[
            "MessageId",
            "CorrelationId",
            "TimeSent",
            "DestinationAddress",
            "CC",
            "BCC",
        ])?)
        .into(),
        1 => long_string(u, 256, 300)?,
        2 => "a.b".into(),
        3 => short_string(u)?,
        _ => format!("H{}", u.int_in_range(0..=9_999)?),
    })
}

/// A document of arbitrary values.
pub fn any_document(u: &mut Unstructured, depth: u32) -> Result<Document> {
    let n = u.int_in_range(0..=6)?;
    let mut d = Document::new();
    for _ in 0..n {
        // NUL cannot appear in a BSON key.
        let key = header_key(u)?.replace('\0', "");
        d.insert(key, any_bson(u, depth)?);
    }
    Ok(d)
}

/// The `Time` field: due by `due_ms` in one of the shapes writers use, or (with `any_shape`)
/// anything at all, which a due query may never match.
fn time_field(u: &mut Unstructured, due_ms: i64, any_shape: bool) -> Result<Bson> {
    let ticks = due_ms * 10_000 + EPOCH_TICKS;
    let shapes = if any_shape { 7 } else { 4 };
    Ok(match u.int_in_range(0..=shapes)? {
        0..=2 => Bson::Array(vec![Bson::Int64(ticks), Bson::Int32(0)]),
        3 => {
            // Clock-time ticks at an offset, as the C# driver writes a DateTimeOffset. Positive
            // offsets put the raw ticks after the instant, where a ticks-only due query does
            // not see them yet (issue 11): only with `any_shape`.
            let east = if any_shape { 14 * 60 } else { 0 };
            let offset = u.int_in_range(-14 * 60..=east)?;
            Bson::Array(vec![
                Bson::Int64(ticks + i64::from(offset) * 600_000_000),
                Bson::Int32(offset),
            ])
        }
        4 => Bson::Array(vec![Bson::Int64(ticks), any_bson(u, 0)?]),
        5 => Bson::Array(vec![
            Bson::Int64(u.arbitrary()?),
            Bson::Int32(u.arbitrary()?),
        ]),
        6 => Bson::DateTime(DateTime::from_millis(due_ms)),
        _ => any_bson(u, 1)?,
    })
}

/// A `Timeouts` document with hostile values, due at `due_ms` where its `Time` lets it be
/// (with `any_time`, its `Time` may have any shape, that no due query matches). Its
/// `Destination` is `destination` or something hostile; `_id` is unique enough (random bytes)
/// to be inserted many at a time.
pub fn timeout_document(
    u: &mut Unstructured,
    due_ms: i64,
    destination: &str,
    any_time: bool,
) -> Result<Document> {
    let mut d = Document::new();
    let id = match u.int_in_range(0..=9)? {
        0 => Bson::String(format!("id-{}", u.arbitrary::<u64>()?)),
        1 => Bson::Int64(u.arbitrary()?),
        2 => Bson::ObjectId(ObjectId::from_bytes(u.arbitrary()?)),
        3 => Bson::Binary(any_binary(u)?),
        _ => uuid_binary(u)?,
    };
    d.insert("_id", id);
    let dest = match u.int_in_range(0..=9)? {
        0 => Bson::Null,
        1 => Bson::String(String::new()),
        2 => Bson::String(long_string(u, 256, 400)?),
        3 => any_bson(u, 0)?,
        4 => Bson::String(format!("timeoutd-hostile-{}", u.arbitrary::<u32>()?)),
        _ => Bson::String(destination.into()),
    };
    if !u.ratio(1, 20)? {
        d.insert("Destination", dest);
    }
    let pm = if u.ratio(4, 5)? {
        uuid_binary(u)?
    } else {
        any_bson(u, 0)?
    };
    d.insert("ProcessManagerId", pm);
    d.insert("Time", time_field(u, due_ms, any_time)?);
    let headers = match u.int_in_range(0..=9)? {
        0 => any_bson(u, 1)?,
        1 => Bson::Document(bson::doc! {
            "Raw": { "_t": "System.Byte[]", "_v": Bson::Binary(any_binary(u)?) },
        }),
        2 => Bson::Document(bson::doc! { "Big": long_string(u, 140_000, 140_000)? }),
        _ => Bson::Document(any_document(u, 2)?),
    };
    d.insert("Headers", headers);
    d.insert("Locked", false);
    d.insert(
        "LockedBy",
        Bson::Binary(Binary {
            subtype: BinarySubtype::Uuid,
            bytes: vec![0; 16],
        }),
    );
    d.insert("LockExpiresAt", Bson::Null);
    Ok(d)
}

/// Deterministic pseudo-random bytes (splitmix64) for generating documents from a seed.
pub fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// What the record path made of one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// A message that satisfies AMQP's limits.
    Sendable,
    /// Parked at once, with this reason.
    Parked(&'static str),
}

/// Runs one stored document through the whole record path, as the dispatch loop does:
/// decoding, triage, message building against `frame_max`. Fails if anything panics, or if a
/// message comes out that breaks the protocol; else says whether it is sent or parked.
pub fn record_path(
    doc: &Document,
    encoding: timeoutd::config::TimeEncoding,
    frame_max: u32,
) -> std::result::Result<Fate, String> {
    use timeoutd::record::message::{self, Unsendable};
    let run = || {
        let record = timeoutd::record::TimeoutRecord::decode(doc, encoding);
        let record = match timeoutd::dispatch::triage(record) {
            Ok(r) => r,
            Err((reason, _)) => return Ok(Fate::Parked(reason.as_str())),
        };
        let rabbit = timeoutd::config::RabbitConfig::default();
        match message::build_contained(&record, &rabbit, std::time::SystemTime::now(), frame_max) {
            Ok(m) => check_protocol(&m, frame_max).map(|()| Fate::Sendable),
            Err(Unsendable::Panicked(p)) => Err(format!("building the message panicked: {p}")),
            Err(_) => Ok(Fate::Parked("unsendable")),
        }
    };
    std::panic::catch_unwind(run).unwrap_or_else(|p| {
        Err(format!(
            "the record path panicked: {}",
            timeoutd::service::supervisor::panic_message(p.as_ref())
        ))
    })
}

/// The message satisfies what AMQP and ServiceConnect's receivers require.
pub fn check_protocol(
    m: &timeoutd::record::message::OutgoingMessage,
    frame_max: u32,
) -> std::result::Result<(), String> {
    use lapin::types::AMQPValue;
    if m.routing_key.is_empty() || m.routing_key.len() > 255 {
        return Err(format!("routing key of {} bytes", m.routing_key.len()));
    }
    let size = timeoutd::record::message::header_frame_size(&m.properties);
    if size > frame_max as usize {
        return Err(format!(
            "content header of {size} bytes past frame_max {frame_max}"
        ));
    }
    let headers = m.properties.headers().as_ref().ok_or("no headers")?;
    for (k, v) in headers.inner() {
        if k.as_str().len() > 255 {
            return Err(format!("header name of {} bytes", k.as_str().len()));
        }
        if !matches!(v, AMQPValue::LongString(_)) {
            return Err(format!("header {} is not a long string", k.as_str()));
        }
        // RabbitMQ reads these as routing keys: a string there makes it refuse the message
        // and close the channel (406), and every publish pipelined behind it fails.
        if matches!(k.as_str(), "CC" | "BCC") {
            return Err(format!("header {} as a string", k.as_str()));
        }
    }
    let body: serde_json::Value =
        serde_json::from_slice(&m.body).map_err(|e| format!("body is not JSON: {e}"))?;
    let correlation = body["CorrelationId"].as_str().ok_or("no CorrelationId")?;
    uuid::Uuid::parse_str(correlation).map_err(|e| format!("CorrelationId: {e}"))?;
    if m.properties.message_id().is_none() {
        return Err("no message_id".into());
    }
    Ok(())
}
