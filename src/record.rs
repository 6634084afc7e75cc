//! The ServiceConnect v7 timeout record: decoding a raw `Timeouts` document into a typed
//! [`TimeoutRecord`], and the .NET `DateTimeOffset` tick arithmetic of its `Time` field.
//!
//! Decoding never panics: anything unexpected becomes a [`DecodeError`] naming the field, and
//! the record is left for a later poll (or parked, once parking exists).

use bson::spec::BinarySubtype;
use bson::{Bson, DateTime, Document};
use uuid::Uuid;

use crate::config::TimeEncoding;

/// Field names of the ServiceConnect document. The record must never gain other fields.
pub mod field {
    pub const ID: &str = "_id";
    pub const DESTINATION: &str = "Destination";
    pub const PROCESS_MANAGER_ID: &str = "ProcessManagerId";
    pub const TIME: &str = "Time";
    /// The ticks element of an array-encoded `Time`, the key the due query and index use.
    pub const TIME_TICKS: &str = "Time.0";
    pub const HEADERS: &str = "Headers";
    pub const LOCKED: &str = "Locked";
    pub const LOCKED_BY: &str = "LockedBy";
    pub const LOCK_EXPIRES_AT: &str = "LockExpiresAt";
}

/// .NET ticks (100 ns since 0001-01-01) at the Unix epoch.
pub const UNIX_EPOCH_TICKS: i64 = 621_355_968_000_000_000;
/// .NET ticks per millisecond.
pub const TICKS_PER_MS: i64 = 10_000;
const TICKS_PER_MINUTE: i64 = 600_000_000;

/// Unix milliseconds to .NET ticks.
pub fn ms_to_ticks(unix_ms: i64) -> i64 {
    unix_ms
        .saturating_mul(TICKS_PER_MS)
        .saturating_add(UNIX_EPOCH_TICKS)
}

/// .NET ticks to Unix milliseconds (rounded down).
pub fn ticks_to_ms(ticks: i64) -> i64 {
    (ticks - UNIX_EPOCH_TICKS).div_euclid(TICKS_PER_MS)
}

/// The BSON value of `Time` for a due instant, in the given encoding.
pub fn encode_time(due: DateTime, encoding: TimeEncoding) -> Bson {
    match encoding {
        TimeEncoding::DotnetTicks => Bson::Array(vec![
            Bson::Int64(ms_to_ticks(due.timestamp_millis())),
            Bson::Int32(0),
        ]),
        TimeEncoding::Date => Bson::DateTime(due),
    }
}

/// A BSON Binary subtype 4 UUID, as ServiceConnect stores ids.
pub fn uuid_bson(id: Uuid) -> Bson {
    Bson::Binary(bson::Binary {
        subtype: BinarySubtype::Uuid,
        bytes: id.as_bytes().to_vec(),
    })
}

/// Reads a Binary subtype 4 value as a UUID.
pub fn bson_uuid(value: &Bson) -> Option<Uuid> {
    match value {
        Bson::Binary(b) if b.subtype == BinarySubtype::Uuid => Uuid::from_slice(&b.bytes).ok(),
        _ => None,
    }
}

/// The `_id`s of documents (as read with an `_id` projection).
pub fn ids_of(docs: Vec<Document>) -> Vec<Bson> {
    docs.into_iter()
        .filter_map(|d| d.get(field::ID).cloned())
        .collect()
}

/// An `_id` for logs: the UUID when it is one, else the raw BSON.
pub fn display_id(id: &Bson) -> String {
    bson_uuid(id)
        .map(|u| u.to_string())
        .unwrap_or_else(|| id.to_string())
}

/// A decoded timeout record.
#[derive(Debug, Clone, PartialEq)]
pub struct TimeoutRecord {
    pub id: Uuid,
    /// The queue to send to; empty when the writer stored null or `""`.
    pub destination: String,
    pub process_manager_id: Uuid,
    /// The due instant (UTC).
    pub due: DateTime,
    /// Custom headers as stored; [`crate::message`] turns them into AMQP strings.
    pub headers: Document,
}

/// Why a stored document is not a usable timeout record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("_id is missing or not a UUID (Binary subtype 4)")]
    Id,
    #[error("Destination is not a string")]
    Destination,
    #[error("ProcessManagerId is missing or not a UUID (Binary subtype 4)")]
    ProcessManagerId,
    #[error("Time is missing or not {0}")]
    Time(&'static str),
    #[error("Headers is not a document")]
    Headers,
}

impl TimeoutRecord {
    /// Only the due instant of a raw document, when its `Time` decodes.
    pub fn decode_due(doc: &Document, encoding: TimeEncoding) -> Option<DateTime> {
        decode_time(doc.get(field::TIME), encoding).ok()
    }

    /// Decodes a raw `Timeouts` document.
    pub fn decode(doc: &Document, encoding: TimeEncoding) -> Result<Self, DecodeError> {
        let id = doc
            .get(field::ID)
            .and_then(bson_uuid)
            .filter(|u| !u.is_nil())
            .ok_or(DecodeError::Id)?;
        let destination = match doc.get(field::DESTINATION) {
            None | Some(Bson::Null) => String::new(),
            Some(Bson::String(s)) => s.clone(),
            Some(_) => return Err(DecodeError::Destination),
        };
        let process_manager_id = doc
            .get(field::PROCESS_MANAGER_ID)
            .and_then(bson_uuid)
            .ok_or(DecodeError::ProcessManagerId)?;
        let due = decode_time(doc.get(field::TIME), encoding)?;
        let headers = match doc.get(field::HEADERS) {
            None | Some(Bson::Null) => Document::new(),
            Some(Bson::Document(d)) => d.clone(),
            Some(_) => return Err(DecodeError::Headers),
        };
        Ok(Self {
            id,
            destination,
            process_manager_id,
            due,
            headers,
        })
    }

    /// The document ServiceConnect v7 would write for this record: free, with every field.
    pub fn to_document(&self, encoding: TimeEncoding) -> Document {
        let mut d = Document::new();
        d.insert(field::ID, uuid_bson(self.id));
        d.insert(field::DESTINATION, self.destination.clone());
        d.insert(
            field::PROCESS_MANAGER_ID,
            uuid_bson(self.process_manager_id),
        );
        d.insert(field::TIME, encode_time(self.due, encoding));
        d.insert(field::HEADERS, self.headers.clone());
        d.insert(field::LOCKED, false);
        d.insert(field::LOCKED_BY, uuid_bson(Uuid::nil()));
        d.insert(field::LOCK_EXPIRES_AT, Bson::Null);
        d
    }
}

fn decode_time(value: Option<&Bson>, encoding: TimeEncoding) -> Result<DateTime, DecodeError> {
    match encoding {
        TimeEncoding::Date => match value {
            Some(Bson::DateTime(d)) => Ok(*d),
            _ => Err(DecodeError::Time("a BSON Date")),
        },
        TimeEncoding::DotnetTicks => {
            const EXPECTED: &str = "an array [Int64 ticks, Int32 offsetMinutes]";
            let Some(Bson::Array(parts)) = value else {
                return Err(DecodeError::Time(EXPECTED));
            };
            let integer = |b: &Bson| match b {
                Bson::Int64(v) => Some(*v),
                Bson::Int32(v) => Some(i64::from(*v)),
                _ => None,
            };
            let (Some(ticks), Some(offset)) = (
                parts.first().and_then(integer),
                parts.get(1).and_then(integer),
            ) else {
                return Err(DecodeError::Time(EXPECTED));
            };
            if parts.len() != 2 || !(0..=3_155_378_975_999_999_999).contains(&ticks) {
                return Err(DecodeError::Time(EXPECTED));
            }
            // DateTimeOffset stores clock ticks at its offset; UTC is ticks minus the offset.
            let utc_ticks = ticks - offset.clamp(-14 * 60, 14 * 60) * TICKS_PER_MINUTE;
            Ok(DateTime::from_millis(ticks_to_ms(utc_ticks)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn ticks_match_the_interop_example() {
        // 2026-01-01T00:00Z is [639028224000000000, 0].
        let ms = 1_767_225_600_000;
        assert_eq!(ms_to_ticks(ms), 639_028_224_000_000_000);
        assert_eq!(ticks_to_ms(639_028_224_000_000_000), ms);
        assert_eq!(ticks_to_ms(ms_to_ticks(-1)), -1);
    }

    fn v7_doc() -> Document {
        doc! {
            "_id": uuid_bson(Uuid::from_u128(1)),
            "Destination": "orders",
            "ProcessManagerId": uuid_bson(Uuid::from_u128(2)),
            "Time": [639_028_224_000_000_000_i64, 0_i32],
            "Headers": { "Tenant": "a" },
            "Locked": false,
            "LockedBy": uuid_bson(Uuid::nil()),
            "LockExpiresAt": Bson::Null,
        }
    }

    #[test]
    fn decodes_v7_and_round_trips() {
        let r = TimeoutRecord::decode(&v7_doc(), TimeEncoding::DotnetTicks).unwrap();
        assert_eq!(r.id, Uuid::from_u128(1));
        assert_eq!(r.destination, "orders");
        assert_eq!(r.due.timestamp_millis(), 1_767_225_600_000);
        assert_eq!(r.to_document(TimeEncoding::DotnetTicks), v7_doc());
    }

    #[test]
    fn non_utc_offset_is_converted() {
        let mut d = v7_doc();
        // 01:00 at +60 minutes is 00:00 UTC.
        d.insert(
            "Time",
            vec![
                Bson::Int64(639_028_224_000_000_000 + 36_000_000_000),
                Bson::Int32(60),
            ],
        );
        let r = TimeoutRecord::decode(&d, TimeEncoding::DotnetTicks).unwrap();
        assert_eq!(r.due.timestamp_millis(), 1_767_225_600_000);
    }

    #[test]
    fn rejects_each_bad_field() {
        let cases: Vec<(&str, Bson, DecodeError)> = vec![
            ("_id", Bson::String("x".into()), DecodeError::Id),
            ("_id", uuid_bson(Uuid::nil()), DecodeError::Id),
            ("Destination", Bson::Int32(3), DecodeError::Destination),
            (
                "ProcessManagerId",
                Bson::String("3f2504e0-4f89-11d3-9a0c-0305e82c3301".into()),
                DecodeError::ProcessManagerId,
            ),
            ("Headers", Bson::Array(vec![]), DecodeError::Headers),
        ];
        for (key, value, expected) in cases {
            let mut d = v7_doc();
            d.insert(key, value);
            assert_eq!(
                TimeoutRecord::decode(&d, TimeEncoding::DotnetTicks),
                Err(expected)
            );
        }
        for bad_time in [
            Bson::DateTime(DateTime::now()),
            Bson::Array(vec![Bson::Int64(1)]),
            Bson::Array(vec![Bson::String("1".into()), Bson::Int32(0)]),
            Bson::Array(vec![Bson::Int64(-5), Bson::Int32(0)]),
        ] {
            let mut d = v7_doc();
            d.insert("Time", bad_time);
            assert!(matches!(
                TimeoutRecord::decode(&d, TimeEncoding::DotnetTicks),
                Err(DecodeError::Time(_))
            ));
        }
        assert!(matches!(
            TimeoutRecord::decode(&v7_doc(), TimeEncoding::Date),
            Err(DecodeError::Time(_))
        ));
    }

    #[test]
    fn null_destination_reads_as_empty() {
        let mut d = v7_doc();
        d.insert("Destination", Bson::Null);
        let r = TimeoutRecord::decode(&d, TimeEncoding::DotnetTicks).unwrap();
        assert_eq!(r.destination, "");
    }
}
