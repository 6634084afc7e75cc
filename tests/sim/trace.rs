//! The trace of one run: every event the simulation saw (each call to a model and its answer,
//! each publish and its confirm, each fault), stamped with the virtual time. Its hash is what
//! "the same seed replays the same trace" compares; its tail is what a failure prints.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

/// Lines kept for printing: the last ones lead to the failure.
const KEPT: usize = 400;

#[derive(Debug, Default)]
struct Inner {
    hash: u64,
    events: u64,
    tail: VecDeque<String>,
    /// Keep every line (for `--seed S --trace`).
    all: Option<Vec<String>>,
}

/// A cheap handle on the run's trace.
#[derive(Debug, Clone, Default)]
pub struct Trace(Arc<Mutex<Inner>>);

impl Trace {
    pub fn new(keep_all: bool) -> Self {
        let t = Self::default();
        t.lock().hash = 0xcbf2_9ce4_8422_2325;
        if keep_all {
            t.lock().all = Some(Vec::new());
        }
        t
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records one event at `at_ms` of virtual time by `who` (an instance, a model, a fault).
    pub fn event(&self, at_ms: u64, who: &str, what: impl std::fmt::Display) {
        let mut line = String::new();
        let _ = write!(line, "{at_ms:>9} {who:<6} {what}");
        let mut inner = self.lock();
        // FNV-1a over the line (and a separator).
        let mut h = inner.hash;
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        inner.hash = h;
        inner.events += 1;
        if inner.tail.len() == KEPT {
            inner.tail.pop_front();
        }
        if let Some(all) = inner.all.as_mut() {
            all.push(line.clone());
        }
        inner.tail.push_back(line);
    }

    pub fn hash(&self) -> u64 {
        self.lock().hash
    }

    pub fn events(&self) -> u64 {
        self.lock().events
    }

    /// The last `n` lines.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let inner = self.lock();
        let skip = inner.tail.len().saturating_sub(n);
        inner.tail.iter().skip(skip).cloned().collect()
    }

    /// Every line, when kept.
    pub fn all(&self) -> Option<Vec<String>> {
        self.lock().all.clone()
    }
}

/// A short, stable rendering of a BSON value for trace lines (ids, filters).
pub fn short(value: &impl std::fmt::Display, max: usize) -> String {
    let s = value.to_string();
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &s[..cut])
}
