//! The info line each wave leaves in the log: how many records were sent, refused or failed,
//! how late, and to which destinations (so an operator can follow a saga's timeout by its
//! destination without debug logs).

use std::collections::BTreeMap;
use std::time::Duration;

/// Most destinations a wave summary names; the rest are counted.
const SUMMARY_DESTINATIONS: usize = 20;

/// One info line per wave: how many records, how late, to which destinations.
#[derive(Debug, Default)]
pub(super) struct WaveSummary {
    sent: usize,
    pub(super) refused: usize,
    pub(super) failed: usize,
    late_ms: Option<(i64, i64)>,
    destinations: BTreeMap<String, usize>,
}

impl WaveSummary {
    pub(super) fn confirmed(&mut self, destination: &str, late_ms: i64) {
        self.sent += 1;
        let (lo, hi) = self.late_ms.unwrap_or((late_ms, late_ms));
        self.late_ms = Some((lo.min(late_ms), hi.max(late_ms)));
        let named = self.destinations.len() < SUMMARY_DESTINATIONS
            || self.destinations.contains_key(destination);
        let key = if named { destination } else { "(others)" };
        *self.destinations.entry(key.to_string()).or_default() += 1;
    }

    pub(super) fn log(&self, took: Duration) {
        let (late_min, late_max) = self.late_ms.unwrap_or_default();
        // `q1=3 q2=5`.
        let destinations: Vec<String> = self
            .destinations
            .iter()
            .map(|(d, n)| format!("{d}={n}"))
            .collect();
        tracing::info!(
            sent = self.sent,
            refused = self.refused,
            failed = self.failed,
            late_ms_min = late_min,
            late_ms_max = late_max,
            destinations = %destinations.join(" "),
            took_ms = took.as_millis() as u64,
            "wave sent"
        );
    }
}
