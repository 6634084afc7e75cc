//! When the next claim runs, and the claim in flight: the dispatch machine's claim schedule
//! ([`Claims`]). Plain data, no I/O; `machine.rs` drives it.

use std::time::Duration;
use tokio::time::Instant;

use crate::host::backoff::Backoff;
use crate::store::claim::Candidates;
use crate::store::pacing::Pacing;

/// The claim in flight.
#[derive(Debug)]
pub(super) enum Step {
    Idle,
    /// Reading; `gate`: whether it started beside a wave the broker had not answered.
    Reading {
        started: Instant,
        gate: Gate,
    },
    /// Read; waiting for the first answer to the wave in flight before taking them.
    Gated {
        started: Instant,
        spent: Duration,
        candidates: Candidates,
    },
    Taking {
        started: Instant,
        spent: Duration,
        resumed: Instant,
    },
}

/// What a claim that started beside an unanswered wave waits for before it takes anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Gate {
    /// Nothing: the link had proved it answers.
    Open,
    /// The wave's first answer.
    Waiting,
    /// The wave ended (or shutdown began) unanswered: the claim takes nothing.
    Shut,
}

/// When the next claim runs: every poll interval counted from the start of the last claim, at
/// once while more is due, at once after a wake-up (even one that came while a claim ran) or
/// once held records no longer cut a claim short (`cut_at`), later after a failure, and never
/// during the hold-off after unconfirmed waves.
#[derive(Debug)]
pub(super) struct Claims {
    pub(super) poll: Duration,
    pub(super) step: Step,
    pub(super) next_at: Instant,
    /// A wake-up came while a claim ran: claim again as soon as it returns.
    pub(super) woken: bool,
    /// Where the last claim stopped reading (server ms) when held records cut its look-ahead
    /// short ([`super::machine::Machine::claim_ahead`]): records due past it are unseen, and
    /// once a claim may read further (the soonest held went out), one comes at once.
    pub(super) cut_at: Option<i64>,
    /// No claim before this (publishes went unconfirmed), whatever else says "at once".
    pub(super) not_before: Instant,
    /// Spaces claims after failures (and after a timed-out one, not before its abandoned run
    /// ended on the server: `[mongodb] operation_timeout` more).
    pub(super) failures: Pacing,
    /// Spaces claims after waves whose publishes went unconfirmed; reset only by a wave the
    /// broker confirmed. Not the reconnect back-off: the link that withholds confirms
    /// reconnects fine, and the hold-off must grow all the same (issue 25, 8.5).
    pub(super) unconfirmed: Backoff,
}

impl Claims {
    pub(super) fn next_at(&self) -> Instant {
        self.next_at.max(self.not_before)
    }

    pub(super) fn wake(&mut self, at: Instant) {
        match self.step {
            Step::Idle => self.next_at = at,
            _ => self.woken = true,
        }
    }

    pub(super) fn finished(&mut self, started: Instant, more: bool, at: Instant) {
        self.step = Step::Idle;
        self.next_at = if more || std::mem::take(&mut self.woken) {
            at
        } else {
            // `poll_interval` comes from the configuration: it may be absurd.
            crate::deadline::later(started, self.poll)
        };
    }

    /// A claim failed: try again after `wait`. A wake-up that came while it ran or comes once
    /// it failed (an insert, a change of pauses or shapes) claims at once all the same,
    /// beside a timed-out run the server may still be running: the one exception to
    /// `store/pacing.rs`'s rule, and a bounded one (one claim at a time, so at most one
    /// abandoned run beside it), taken because a timeout must fire on time. Holding it to
    /// `wait` made a record inserted after a lost reply 348 ms late where 250 are allowed (the
    /// simulation's `late` invariant, seed 215).
    pub(super) fn failed(&mut self, wait: Duration, at: Instant) {
        self.step = Step::Idle;
        // A wake-up that came while the failed claim ran counts as one that comes after it.
        self.next_at = match std::mem::take(&mut self.woken) {
            true => at,
            false => at + wait,
        };
    }

    pub(super) fn hold_off(&mut self, wait: Duration, at: Instant) {
        self.not_before = self.not_before.max(at + wait);
    }
}
