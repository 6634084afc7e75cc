//! The collection shape a run measures on: what users' `Timeouts` collections look like.

use bson::{Bson, DateTime, Document, doc};
use mongodb::{Collection, IndexModel};
use timeoutd::config::{TimeEncoding, UuidRepresentation};
use timeoutd::record::{TimeoutRecord, field, ms_to_ticks};

/// `TIMEOUTD_BENCH_SHAPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// The lease-era schema (interop doc sections 2 and 3): `Time` is `[ticks, 0]`, standard
    /// GUIDs, every lease field, and v7's three indexes, which every write maintains.
    V7,
    /// What public ServiceConnect releases write (section 7): `Time` a BSON date, C#-legacy
    /// GUIDs (subtype 3), `Locked` but no `LockedBy`/`LockExpiresAt`, and no index but `_id`.
    Public,
}

/// ServiceConnect v7's indexes (interop doc section 3), by the names it gives them.
pub const V7_INDEXES: &[(&str, &[&str])] = &[
    ("Time_1_Locked_1", &["Time", "Locked"]),
    ("LockedBy_1_Locked_1", &["LockedBy", "Locked"]),
    ("LockExpiresAt_1", &["LockExpiresAt"]),
];

impl Shape {
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var("TIMEOUTD_BENCH_SHAPE").as_deref() {
            Err(_) | Ok("") | Ok("v7") => Ok(Self::V7),
            Ok("public") => Ok(Self::Public),
            Ok(other) => anyhow::bail!("TIMEOUTD_BENCH_SHAPE: `{other}` is neither v7 nor public"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::V7 => "v7",
            Self::Public => "public",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::V7 => {
                "v7 lease-era: Time [ticks, 0], standard GUIDs, indexes Time_1_Locked_1, LockedBy_1_Locked_1, LockExpiresAt_1"
            }
            Self::Public => {
                "public release: Time a BSON date, C#-legacy GUIDs, no LockedBy/LockExpiresAt, no index but _id"
            }
        }
    }

    pub fn encoding(self) -> TimeEncoding {
        match self {
            Self::V7 => TimeEncoding::DotnetTicks,
            Self::Public => TimeEncoding::Date,
        }
    }

    /// The daemons' `[mongodb] time_encoding` value.
    pub fn encoding_key(self) -> &'static str {
        match self {
            Self::V7 => "dotnet-ticks",
            Self::Public => "date",
        }
    }

    pub fn uuids(self) -> UuidRepresentation {
        match self {
            Self::V7 => UuidRepresentation::Standard,
            Self::Public => UuidRepresentation::CsharpLegacy,
        }
    }

    /// The daemons' `[mongodb] uuid_representation` value.
    pub fn uuids_key(self) -> &'static str {
        match self {
            Self::V7 => "standard",
            Self::Public => "csharp-legacy",
        }
    }

    /// The record as a fleet of this shape stores it.
    pub fn document(self, r: &TimeoutRecord) -> Document {
        let mut d = r.to_document_as(self.encoding(), self.uuids());
        if self == Self::Public {
            d.remove(field::LOCKED_BY);
            d.remove(field::LOCK_EXPIRES_AT);
        }
        d
    }

    /// The path a due query reads, and the value a due instant has there.
    pub fn due_path(self) -> &'static str {
        match self {
            Self::V7 => "Time.0",
            Self::Public => "Time",
        }
    }

    pub fn due_value(self, unix_ms: i64) -> Bson {
        match self {
            Self::V7 => Bson::Int64(ms_to_ticks(unix_ms)),
            Self::Public => Bson::DateTime(DateTime::from_millis(unix_ms)),
        }
    }

    /// Creates the indexes a collection of this shape has before anything runs on it.
    pub async fn prepare(self, coll: &Collection<Document>) -> anyhow::Result<()> {
        if self == Self::Public {
            return Ok(());
        }
        for (name, fields) in V7_INDEXES {
            let mut keys = Document::new();
            for f in *fields {
                keys.insert(*f, 1);
            }
            create_index(coll, name, keys).await?;
        }
        Ok(())
    }
}

pub async fn create_index(
    coll: &Collection<Document>,
    name: &str,
    keys: Document,
) -> anyhow::Result<()> {
    coll.create_index(
        IndexModel::builder()
            .keys(keys)
            .options(
                mongodb::options::IndexOptions::builder()
                    .name(name.to_string())
                    .build(),
            )
            .build(),
    )
    .await?;
    Ok(())
}

/// The claim's free-and-due guard, in the explicit `$and` form timeoutd writes.
pub fn due_and_free(shape: Shape, now_ms: i64) -> Vec<Document> {
    vec![
        doc! { shape.due_path(): { "$lte": shape.due_value(now_ms) } },
        doc! { "$or": [ { "Locked": false }, { "LockExpiresAt": { "$lte": DateTime::from_millis(now_ms) } } ] },
    ]
}
