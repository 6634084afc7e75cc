//! Records as the MongoDB C# driver 2.x writes them for ServiceConnect (interop doc, section
//! 7), byte for byte: C# legacy GUIDs, `Time` as a date or as clock ticks at an offset.
#![allow(dead_code)]

use std::time::SystemTime;

use bson::spec::BinarySubtype;
use bson::{Binary, Bson, DateTime, Document, doc};
use timeoutd::config::Config;
use timeoutd::store::Store;
use timeoutd::store::clock::ServerClock;
use uuid::Uuid;

use super::{Received, ticks, v7_record};

/// .NET ticks per minute, written out here rather than taken from the crate.
pub const TICKS_PER_MINUTE: i64 = 600_000_000;

/// A GUID as the C# driver's `CSharpLegacy` stores it: `Guid.ToByteArray()`, whose first
/// three groups are little-endian.
pub fn legacy(u: Uuid) -> Bson {
    let b = u.as_bytes();
    let bytes = vec![
        b[3], b[2], b[1], b[0], b[5], b[4], b[7], b[6], b[8], b[9], b[10], b[11], b[12], b[13],
        b[14], b[15],
    ];
    Bson::Binary(Binary {
        subtype: BinarySubtype::UuidOld,
        bytes,
    })
}

/// A record as every public ServiceConnect release writes it with the C# driver 2.x
/// defaults: legacy GUIDs, `Time` a date, no lease fields.
pub fn public_record(id: Uuid, destination: &str, pm: Uuid, due: DateTime) -> Document {
    doc! {
        "_id": legacy(id),
        "Destination": destination,
        "ProcessManagerId": legacy(pm),
        "Time": due,
        "Headers": {
            "Tenant": "acme",
            "Token": { "_t": "System.Byte[]", "_v": Binary { subtype: BinarySubtype::Generic, bytes: b"hi".to_vec() } },
        },
        "Locked": false,
    }
}

/// A lease-era record whose `Time` a writer at `offset` minutes stored: clock ticks there.
pub fn offset_record(
    id: Uuid,
    destination: &str,
    pm: Uuid,
    due: DateTime,
    offset: i32,
) -> Document {
    let mut d = v7_record(id, destination, pm, due, doc! {});
    d.insert(
        "Time",
        vec![
            Bson::Int64(ticks(due) + i64::from(offset) * TICKS_PER_MINUTE),
            Bson::Int32(offset),
        ],
    );
    d
}

pub fn time_sent_ms(r: &Received) -> i64 {
    let s = r.header("TimeSent").expect("TimeSent");
    humantime::parse_rfc3339(&s)
        .unwrap_or_else(|e| panic!("TimeSent {s}: {e}"))
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

pub async fn store_with(config: &Config) -> Store {
    let s = Store::connect(&config.mongodb, ServerClock::default())
        .await
        .expect("store")
        .with_settings(config);
    s.refresh_clock().await.expect("server clock");
    s
}
