//! The ServiceConnect v7 timeout record: decoding a raw `Timeouts` document into a typed
//! [`TimeoutRecord`], and the .NET `DateTimeOffset` tick arithmetic of its `Time` field.
//!
//! Decoding never panics: anything unexpected becomes a [`DecodeError`] naming the field, and
//! the dispatch loop parks the record with that reason (`crate::store::parking`).

pub mod due;
pub mod guid;
pub mod message;

use bson::{Bson, DateTime, Document};
use uuid::Uuid;

use crate::config::{TimeEncoding, UuidRepresentation};

/// Field names of the ServiceConnect document. The record must never gain other fields.
pub mod field {
    pub const ID: &str = "_id";
    pub const DESTINATION: &str = "Destination";
    pub const PROCESS_MANAGER_ID: &str = "ProcessManagerId";
    pub const TIME: &str = "Time";
    /// The ticks element of an array-encoded `Time`, the key the due query and index use.
    pub const TIME_TICKS: &str = "Time.0";
    /// The offset element (minutes) of an array-encoded `Time`.
    pub const TIME_OFFSET: &str = "Time.1";
    pub const HEADERS: &str = "Headers";
    pub const LOCKED: &str = "Locked";
    pub const LOCKED_BY: &str = "LockedBy";
    pub const LOCK_EXPIRES_AT: &str = "LockExpiresAt";
    /// Not ServiceConnect's: set by [`super::from_stored`] on a document read with bytes
    /// that are not UTF-8, never written to `Timeouts` (see there).
    pub const INVALID_UTF8: &str = "timeoutd.invalid_utf8";
}

/// Whether a stored document can be addressed by its `_id`: it has one, and [`from_stored`]
/// did not alter it (an `_id` string with bytes that are not UTF-8 cannot be written back
/// into a filter, so no claim, release or park would match the record).
pub fn addressable(doc: &Document) -> bool {
    let altered = doc
        .get_document(field::INVALID_UTF8)
        .and_then(|bad| bad.get_array("fields"))
        .is_ok_and(|fields| fields.iter().any(|f| f.as_str() == Some(field::ID)));
    doc.contains_key(field::ID) && !altered
}

/// A document as the server sent it, read whatever its strings hold. BSON strings must be
/// UTF-8, and the `bson` crate refuses a document with one that is not: read as a
/// `Document`, one such record, written by a client that does not check (MongoDB stores what
/// it is sent), failed every read of the batch it was in, and so every claim of the fleet
/// (found in review). Such a document is read with each bad string lossily decoded (U+FFFD),
/// and [`field::INVALID_UTF8`] added: the top-level fields that held the bad bytes and the
/// document's original bytes. [`TimeoutRecord::decode`] refuses it, so the record is parked
/// with that reason and its bytes kept; a requeue will not put the altered copy back.
pub fn from_stored(raw: &bson::RawDocument) -> Document {
    if let Ok(doc) = Document::try_from(raw) {
        return doc;
    }
    let mut fields = Vec::new();
    for element in raw.iter_elements() {
        match element {
            Ok(e) => {
                if e.value().and_then(Bson::try_from).is_err() {
                    fields.push(e.key().to_owned());
                }
            }
            Err(e) => fields.push(e.key().unwrap_or("?").to_owned()),
        }
    }
    let lossy = bson::from_slice::<bson::serde_helpers::Utf8LossyDeserialization<Document>>;
    let mut doc = lossy(raw.as_bytes()).map(|d| d.0).unwrap_or_default();
    if !doc.contains_key(field::ID)
        && let Ok(Some(id)) = raw.get(field::ID)
        && let Ok(id) = Bson::try_from(id)
    {
        doc.insert(field::ID, id);
    }
    let bytes = bson::Binary {
        subtype: bson::spec::BinarySubtype::Generic,
        bytes: raw.as_bytes().to_vec(),
    };
    doc.insert(
        field::INVALID_UTF8,
        bson::doc! { "fields": fields, "bytes": bytes },
    );
    doc
}

/// .NET ticks (100 ns since 0001-01-01) at the Unix epoch.
pub const UNIX_EPOCH_TICKS: i64 = 621_355_968_000_000_000;
/// .NET ticks per millisecond.
pub const TICKS_PER_MS: i64 = 10_000;

/// Unix milliseconds to .NET ticks.
pub fn ms_to_ticks(unix_ms: i64) -> i64 {
    unix_ms
        .saturating_mul(TICKS_PER_MS)
        .saturating_add(UNIX_EPOCH_TICKS)
}

/// .NET ticks to Unix milliseconds, rounded up: .NET writes `Time` to 100 ns, and a due
/// instant read a fraction of a millisecond early would let the record go out that early.
pub fn ticks_to_ms(ticks: i64) -> i64 {
    let since_epoch = ticks.saturating_sub(UNIX_EPOCH_TICKS);
    let part = i64::from(since_epoch.rem_euclid(TICKS_PER_MS) != 0);
    since_epoch.div_euclid(TICKS_PER_MS) + part
}

/// The BSON value of `Time` for a due instant, in the given encoding (see [`due::encode`]).
pub fn encode_time(due: DateTime, encoding: TimeEncoding) -> Bson {
    due::encode(due, encoding)
}

/// A GUID as BSON Binary subtype 4 (standard representation).
pub fn uuid_bson(id: Uuid) -> Bson {
    guid::to_bson(id, UuidRepresentation::Standard)
}

/// Reads a GUID stored as Binary subtype 4 or as subtype 3 in the C# legacy byte order, as
/// .NET prints it (see [`crate::record::guid`]).
pub fn bson_uuid(value: &Bson) -> Option<Uuid> {
    guid::from_bson(value)
}

/// The `_id`s of documents (as read with an `_id` projection).
pub fn ids_of(docs: Vec<Document>) -> Vec<Bson> {
    docs.into_iter()
        .filter_map(|d| d.get(field::ID).cloned())
        .collect()
}

/// A record id as a map key: its BSON encoding, so that ids of different types stay apart, as
/// `Bson` equality keeps them (`Bson` has no `Hash`).
pub fn id_key(id: &Bson) -> Vec<u8> {
    let mut key = Vec::new();
    // Writing to a Vec fails only for a document too large for BSON, which no id is.
    let _ = bson::doc! { "": id.clone() }.to_writer(&mut key);
    key
}

/// An `_id` for logs: the GUID as .NET prints it when it is one, else the raw BSON.
pub fn display_id(id: &Bson) -> String {
    bson_uuid(id)
        .map(|u| u.to_string())
        .unwrap_or_else(|| id.to_string())
}

/// The C# driver's discriminator of a value stored with its .NET type, as in
/// `{ "_t": "System.Byte[]", "_v": BinData(0, ...) }`.
const DISCRIMINATOR: &str = "_t";
const DISCRIMINATED_VALUE: &str = "_v";

/// Stored header values with the C# driver's discriminated form (`{_t, _v}`, used for
/// `object`-typed values such as the `byte[]` headers that arrived from RabbitMQ) unwrapped
/// to their `_v`, so that [`crate::record::message`] formats the value itself. Public for the
/// fuzz target `decode_record`, which drives it on its own.
pub fn normalize_headers(headers: &Document) -> Document {
    let unwrapped = |value: &Bson| match value {
        Bson::Document(d)
            if d.len() == 2 && matches!(d.get(DISCRIMINATOR), Some(Bson::String(_))) =>
        {
            d.get(DISCRIMINATED_VALUE).cloned()
        }
        _ => None,
    };
    headers
        .iter()
        .map(|(k, v)| (k.clone(), unwrapped(v).unwrap_or_else(|| v.clone())))
        .collect()
}

/// How stored records are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoding {
    /// Which `Time` shapes are served.
    pub time: TimeEncoding,
    /// Whether the stored `Headers` are kept (and so forwarded with the message).
    pub forward_headers: bool,
}

impl From<TimeEncoding> for Decoding {
    fn from(time: TimeEncoding) -> Self {
        Self {
            time,
            forward_headers: true,
        }
    }
}

/// A decoded timeout record.
#[derive(Debug, Clone, PartialEq)]
pub struct TimeoutRecord {
    /// The GUID as .NET prints it, whatever its stored representation.
    pub id: Uuid,
    /// The queue to send to; empty when the writer stored null or `""`.
    pub destination: String,
    /// The saga's id as .NET prints it: the message's `CorrelationId`.
    pub process_manager_id: Uuid,
    /// The due instant (UTC).
    pub due: DateTime,
    /// Custom headers, `{_t, _v}` values unwrapped; [`crate::record::message`] turns them into AMQP
    /// strings. Empty when `forward_headers` is off.
    pub headers: Document,
}

/// Why a stored document is not a usable timeout record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "_id is missing, the nil GUID, or not a GUID (Binary subtype 4, or 3 in C# legacy order)"
    )]
    Id,
    #[error("Destination is not a string")]
    Destination,
    #[error(
        "ProcessManagerId is missing or not a GUID (Binary subtype 4, or 3 in C# legacy order)"
    )]
    ProcessManagerId,
    #[error("Time is missing or not {0}")]
    Time(&'static str),
    #[error("Headers is not a document")]
    Headers,
    #[error("not UTF-8 in {0} (the original bytes are kept under `{INVALID_UTF8}`)", INVALID_UTF8 = field::INVALID_UTF8)]
    InvalidUtf8(String),
}

impl TimeoutRecord {
    /// Only the due instant of a raw document, when its `Time` decodes.
    pub fn decode_due(doc: &Document, encoding: TimeEncoding) -> Option<DateTime> {
        due::decode(doc.get(field::TIME), encoding).ok()
    }

    /// Decodes a raw `Timeouts` document (`Decoding::from(encoding)` to keep the headers).
    pub fn decode(doc: &Document, decoding: impl Into<Decoding>) -> Result<Self, DecodeError> {
        let decoding = decoding.into();
        if let Some(bad) = doc.get(field::INVALID_UTF8) {
            let fields = bad.as_document().and_then(|b| b.get_array("fields").ok());
            let names = fields.into_iter().flatten().filter_map(Bson::as_str);
            return Err(DecodeError::InvalidUtf8(
                names.collect::<Vec<_>>().join(", "),
            ));
        }
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
        let due = due::decode(doc.get(field::TIME), decoding.time)?;
        // Headers not forwarded are not read: a record whose `Headers` is not a document is
        // sent without them rather than parked (found in review, helper-34).
        let headers = match doc.get(field::HEADERS) {
            _ if !decoding.forward_headers => Document::new(),
            None | Some(Bson::Null) => Document::new(),
            Some(Bson::Document(d)) => normalize_headers(d),
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

    /// The document ServiceConnect v7 would write for this record (free, every field), with
    /// standard GUIDs.
    pub fn to_document(&self, encoding: TimeEncoding) -> Document {
        self.to_document_as(encoding, UuidRepresentation::Standard)
    }

    /// [`TimeoutRecord::to_document`] with GUIDs in the given representation.
    pub fn to_document_as(&self, encoding: TimeEncoding, uuids: UuidRepresentation) -> Document {
        let mut d = Document::new();
        d.insert(field::ID, guid::to_bson(self.id, uuids));
        d.insert(field::DESTINATION, self.destination.clone());
        d.insert(
            field::PROCESS_MANAGER_ID,
            guid::to_bson(self.process_manager_id, uuids),
        );
        d.insert(field::TIME, encode_time(self.due, encoding));
        d.insert(field::HEADERS, self.headers.clone());
        d.insert(field::LOCKED, false);
        d.insert(field::LOCKED_BY, guid::to_bson(Uuid::nil(), uuids));
        d.insert(field::LOCK_EXPIRES_AT, Bson::Null);
        d
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use bson::doc;

    /// A ServiceConnect record with bytes that are not UTF-8 in `Destination` and in a
    /// header's value, as a client that does not check could store it.
    fn with_invalid_utf8() -> (Uuid, Vec<u8>) {
        let id = Uuid::from_u128(7);
        let record = TimeoutRecord {
            id,
            destination: "q-@@@".into(),
            process_manager_id: Uuid::from_u128(8),
            due: DateTime::from_millis(1_767_225_600_000),
            headers: doc! { "h": "v-@@@" },
        };
        (
            id,
            not_utf8_at_marks(&record.to_document(TimeEncoding::Auto)),
        )
    }

    /// `doc`'s bytes, each `@@@` in its strings replaced by bytes that are not UTF-8.
    pub(crate) fn not_utf8_at_marks(doc: &Document) -> Vec<u8> {
        let mut bytes = bson::to_vec(doc).expect("bytes");
        for at in 0..bytes.len().saturating_sub(2) {
            if bytes[at..at + 3] == *b"@@@" {
                bytes[at..at + 3].copy_from_slice(&[0xff, 0xfe, b'x']);
            }
        }
        bytes
    }

    /// Found in review (helper-34): read as a `Document`, a record with bytes that are not
    /// UTF-8 failed the whole read, so every claim of the fleet; now it is read, refused by
    /// the decoder naming its fields (to be parked), and its bytes kept.
    #[test]
    fn a_document_with_bytes_that_are_not_utf8_is_read_and_refused() {
        let (id, bytes) = with_invalid_utf8();
        let raw = bson::RawDocument::from_bytes(&bytes).expect("well-formed BSON");
        assert!(
            Document::try_from(raw).is_err(),
            "the strict read refuses it"
        );
        let doc = from_stored(raw);
        assert_eq!(doc.get(field::ID), Some(&uuid_bson(id)));
        assert_eq!(doc.get_str(field::DESTINATION), Ok("q-\u{FFFD}\u{FFFD}x"));
        let kept = doc.get_document(field::INVALID_UTF8).expect("marked");
        assert_eq!(
            kept.get_binary_generic("bytes").expect("bytes"),
            &bytes,
            "the original bytes"
        );
        assert_eq!(
            TimeoutRecord::decode(&doc, TimeEncoding::Auto),
            Err(DecodeError::InvalidUtf8("Destination, Headers".into()))
        );
        // A document that is UTF-8 throughout is read as it is, unmarked.
        let good = doc! { field::ID: uuid_bson(id), field::DESTINATION: "q" };
        let good_bytes = bson::to_vec(&good).expect("bytes");
        let read = from_stored(bson::RawDocument::from_bytes(&good_bytes).expect("BSON"));
        assert_eq!(read, good);
    }

    #[test]
    fn ticks_match_the_interop_example() {
        // 2026-01-01T00:00Z is [639028224000000000, 0].
        let ms = 1_767_225_600_000;
        assert_eq!(ms_to_ticks(ms), 639_028_224_000_000_000);
        assert_eq!(ticks_to_ms(639_028_224_000_000_000), ms);
        assert_eq!(ticks_to_ms(ms_to_ticks(-1)), -1);
    }

    #[test]
    fn ticks_between_milliseconds_are_due_at_the_next_one() {
        // .NET's `DateTimeOffset.UtcNow` has 100 ns ticks: 0.0001 ms past a millisecond is
        // not due at that millisecond.
        let ms = 1_767_225_600_000;
        assert_eq!(ticks_to_ms(ms_to_ticks(ms) + 1), ms + 1);
        assert_eq!(ticks_to_ms(ms_to_ticks(ms) + 9_999), ms + 1);
        assert_eq!(ticks_to_ms(ms_to_ticks(-1) + 1), 0);
        assert_eq!(ticks_to_ms(i64::MAX), ticks_to_ms(i64::MAX - 1));
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
        // Headers that are not forwarded are not read, whatever they hold.
        let mut d = v7_doc();
        d.insert("Headers", Bson::Array(vec![]));
        let unread = Decoding {
            time: TimeEncoding::DotnetTicks,
            forward_headers: false,
        };
        let sent = TimeoutRecord::decode(&d, unread).expect("sent without its headers");
        assert!(sent.headers.is_empty());
        for bad_time in [
            Bson::DateTime(crate::host::wall_date()),
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

    /// A record as public ServiceConnect (C# driver 2.x defaults) stores it: C# legacy GUIDs,
    /// `Time` a BSON date, a `byte[]` header in discriminated form, no lease fields.
    fn public_release_doc() -> Document {
        let legacy = |bytes: [u8; 16]| {
            Bson::Binary(bson::Binary {
                subtype: bson::spec::BinarySubtype::UuidOld,
                bytes: bytes.to_vec(),
            })
        };
        doc! {
            // .NET prints these as 00112233-4455-6677-8899-aabbccddeeff and
            // 3f2504e0-4f89-11d3-9a0c-0305e82c3301.
            "_id": legacy([0x33, 0x22, 0x11, 0x00, 0x55, 0x44, 0x77, 0x66, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff]),
            "Destination": "orders",
            "ProcessManagerId": legacy([0xe0, 0x04, 0x25, 0x3f, 0x89, 0x4f, 0xd3, 0x11, 0x9a, 0x0c, 0x03, 0x05, 0xe8, 0x2c, 0x33, 0x01]),
            "Time": DateTime::from_millis(1_767_225_600_000),
            "Headers": {
                "Tenant": "a",
                "Token": { "_t": "System.Byte[]", "_v": bson::Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: b"hi".to_vec() } },
                "Flag": true,
            },
            "Locked": false,
        }
    }

    #[test]
    fn decodes_a_public_release_record() {
        let r = TimeoutRecord::decode(&public_release_doc(), TimeEncoding::Auto).unwrap();
        assert_eq!(r.id.to_string(), "00112233-4455-6677-8899-aabbccddeeff");
        assert_eq!(
            r.process_manager_id.to_string(),
            "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
        );
        assert_eq!(r.due.timestamp_millis(), 1_767_225_600_000);
        assert_eq!(
            r.headers,
            doc! {
                "Tenant": "a",
                "Token": bson::Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: b"hi".to_vec() },
                "Flag": true,
            }
        );
        let legacy = r.to_document_as(TimeEncoding::Date, UuidRepresentation::CsharpLegacy);
        assert_eq!(legacy.get("_id"), public_release_doc().get("_id"));
        assert_eq!(
            legacy.get("ProcessManagerId"),
            public_release_doc().get("ProcessManagerId")
        );
        let quiet = Decoding {
            time: TimeEncoding::Date,
            forward_headers: false,
        };
        assert!(
            TimeoutRecord::decode(&public_release_doc(), quiet)
                .unwrap()
                .headers
                .is_empty()
        );
        assert!(matches!(
            TimeoutRecord::decode(&public_release_doc(), TimeEncoding::DotnetTicks),
            Err(DecodeError::Time(_))
        ));
    }

    #[test]
    fn only_the_exact_discriminated_form_is_unwrapped() {
        let h = doc! {
            "a": { "_t": "System.Byte[]", "_v": 1 },
            "b": { "_t": "x", "_v": 1, "more": 2 },
            "c": { "_t": 5, "_v": 1 },
            "d": { "_v": 1 },
        };
        let n = normalize_headers(&h);
        assert_eq!(n.get("a"), Some(&Bson::Int32(1)));
        for k in ["b", "c", "d"] {
            assert_eq!(n.get(k), h.get(k), "{k}");
        }
    }

    #[test]
    fn null_destination_reads_as_empty() {
        let mut d = v7_doc();
        d.insert("Destination", Bson::Null);
        let r = TimeoutRecord::decode(&d, TimeEncoding::DotnetTicks).unwrap();
        assert_eq!(r.destination, "");
    }
}
