//! The reads of `timeoutd history`: rows of `<collection>_history`, newest first, each field
//! read as hostile (a missing or mistyped one is shown as absent).

use bson::{DateTime, Document, doc};
use serde::Serialize;

use crate::store::history::field;
use crate::store::listing::show_instant;
use crate::store::{Store, StoreError, date, int, text};

/// What `timeoutd history` selects.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub correlation_id: Option<String>,
    pub timeout_id: Option<String>,
    pub destination: Option<String>,
    pub since: Option<DateTime>,
    pub limit: i64,
}

/// One row as `timeoutd history` shows it. Every field may be missing or of the wrong type
/// in a stored row: it is then shown as absent.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Entry {
    pub event: String,
    /// RFC 3339.
    pub at: Option<String>,
    pub timeout_id: String,
    pub correlation_id: Option<String>,
    pub destination: Option<String>,
    pub due: Option<String>,
    pub late_ms: Option<i64>,
    pub attempts: Option<i64>,
    pub message_id: Option<String>,
    pub instance: Option<String>,
    pub reason: Option<String>,
    pub detail: Option<String>,
}

fn instant(d: &Document, key: &str) -> Option<String> {
    date(d, key).and_then(show_instant)
}

impl Entry {
    pub fn from_doc(d: &Document) -> Self {
        Self {
            event: text(d, field::EVENT).unwrap_or_else(|| "-".into()),
            at: instant(d, field::AT),
            timeout_id: text(d, field::TIMEOUT_ID).unwrap_or_else(|| "-".into()),
            correlation_id: text(d, field::CORRELATION_ID),
            destination: text(d, field::DESTINATION),
            due: instant(d, field::DUE),
            late_ms: int(d, field::LATE_MS),
            attempts: int(d, field::ATTEMPTS),
            message_id: text(d, field::MESSAGE_ID),
            instance: text(d, field::INSTANCE),
            reason: text(d, field::REASON),
            detail: text(d, field::DETAIL),
        }
    }
}

impl Store {
    /// Rows of `timeoutd history`, newest first.
    pub async fn read_history(&self, f: &Filter) -> Result<Vec<Entry>, StoreError> {
        let mut filter = Document::new();
        for (key, value) in [
            (field::CORRELATION_ID, &f.correlation_id),
            (field::TIMEOUT_ID, &f.timeout_id),
            (field::DESTINATION, &f.destination),
        ] {
            if let Some(v) = value {
                filter.insert(key, v);
            }
        }
        if let Some(since) = f.since {
            filter.insert(field::AT, doc! { "$gte": since });
        }
        let docs: Vec<Document> = self
            .query(
                self.history()
                    .find(filter)
                    .sort(doc! { field::AT: -1 })
                    .limit(f.limit),
            )
            .await?;
        Ok(docs.iter().map(Entry::from_doc).collect())
    }
}
