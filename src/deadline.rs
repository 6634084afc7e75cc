//! Deadlines. Every call to MongoDB or RabbitMQ, connects and closes included, is bounded: a
//! server that stops answering turns into an error the caller handles, never into a wait that
//! holds up the dispatch loop, the reaper or shutdown. [`in_flight`] counts the MongoDB calls
//! that may still run on the server (`timeoutd_mongodb_calls_in_flight`): a call abandoned at
//! its deadline counts until the server's own deadline (`maxTimeMS`) has surely ended it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// A call that did not finish within its deadline.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{what} did not finish within {limit:?}")]
pub struct Elapsed {
    pub what: &'static str,
    pub limit: Duration,
}

/// Runs `fut` for at most `limit`; past that it is dropped and the error says what it was.
pub async fn within<T, E: From<Elapsed>>(
    limit: Duration,
    what: &'static str,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result,
        Err(_) => Err(Elapsed { what, limit }.into()),
    }
}

/// `at` + `d`, or, past the largest instant the clock can hold, an instant decades away: a
/// duration from the configuration can be absurd (`100000000years`), and `Instant + Duration`
/// panics when the sum overflows.
pub fn later(at: Instant, d: Duration) -> Instant {
    // About 30 years: as far as any wait of timeoutd needs to look.
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    at.checked_add(d)
        .or_else(|| at.checked_add(FAR))
        .unwrap_or(at)
}

/// The calls this process may have running on the server, each with the instant after which
/// it surely ended there (`None` while its caller still waits for it).
static IN_FLIGHT: Mutex<Option<HashMap<u64, Option<Instant>>>> = Mutex::new(None);
static NEXT_CALL: AtomicU64 = AtomicU64::new(0);

fn calls<T>(f: impl FnOnce(&mut HashMap<u64, Option<Instant>>) -> T) -> Option<T> {
    let mut guard = IN_FLIGHT.lock().ok()?;
    Some(f(guard.get_or_insert_with(HashMap::new)))
}

/// Forgets the abandoned calls the server has surely ended by now. Run as calls start and
/// end, not only when something reads [`in_flight`]: the map must not grow with the calls of
/// a process that nothing scrapes.
fn prune(m: &mut HashMap<u64, Option<Instant>>, now: Instant) {
    m.retain(|_, until| until.is_none_or(|t| t > now));
}

/// One bounded call to MongoDB, counted in [`in_flight`] from its start until it returns, or,
/// when its future is dropped (its deadline, shutdown), for twice `operation_timeout` from its
/// start: its last query may have reached the server up to one `operation_timeout` after the
/// call began, and then runs at most its `maxTimeMS`.
#[derive(Debug)]
pub struct CallInFlight {
    id: u64,
    started: Instant,
    outlives: Duration,
    done: bool,
}

impl CallInFlight {
    pub fn start(operation_timeout: Duration) -> Self {
        let id = NEXT_CALL.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        calls(|m| {
            prune(m, started);
            m.insert(id, None)
        });
        Self {
            id,
            started,
            outlives: operation_timeout.saturating_mul(2),
            done: false,
        }
    }

    /// The call returned (whatever its outcome): it no longer runs on the server.
    pub fn finished(mut self) {
        self.done = true;
        calls(|m| {
            m.remove(&self.id);
            prune(m, Instant::now());
        });
    }
}

impl Drop for CallInFlight {
    fn drop(&mut self) {
        if !self.done {
            let until = later(self.started, self.outlives);
            calls(|m| {
                m.insert(self.id, Some(until));
                prune(m, Instant::now());
            });
        }
    }
}

/// How many MongoDB calls this process may have running on the server now
/// (`timeoutd_mongodb_calls_in_flight`).
pub fn in_flight() -> usize {
    let now = Instant::now();
    calls(|m| {
        prune(m, now);
        m.len()
    })
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error(transparent)]
    struct E(#[from] Elapsed);

    #[tokio::test]
    async fn a_call_past_its_deadline_becomes_an_error() {
        let stuck = within(Duration::from_millis(10), "stuck call", async {
            std::future::pending::<Result<(), E>>().await
        })
        .await;
        assert_eq!(
            stuck.unwrap_err().to_string(),
            "stuck call did not finish within 10ms"
        );
        let quick = within(Duration::from_secs(1), "quick call", async {
            Ok::<_, E>(7)
        })
        .await;
        assert_eq!(quick.unwrap(), 7);
    }

    #[test]
    fn an_abandoned_call_stays_counted_until_the_server_ended_it() {
        let counted = |id: u64| {
            in_flight();
            calls(|m| m.contains_key(&id)).unwrap_or(false)
        };
        let returned = CallInFlight::start(Duration::from_secs(60));
        let abandoned = CallInFlight::start(Duration::from_secs(60));
        let expired = CallInFlight::start(Duration::ZERO);
        let ids = (returned.id, abandoned.id, expired.id);
        assert!(counted(ids.0) && counted(ids.1) && counted(ids.2));
        returned.finished();
        drop(abandoned);
        drop(expired);
        assert!(!counted(ids.0), "a call that returned is no longer counted");
        assert!(
            counted(ids.1),
            "a dropped call counts until its server time has passed"
        );
        assert!(!counted(ids.2), "nor after");
    }

    /// The review of issue 25: abandoned calls were forgotten only when a scrape read the
    /// gauge, so a process nothing scrapes kept every one of them.
    #[test]
    fn an_ended_call_is_forgotten_without_a_scrape() {
        let present = |id: u64| calls(|m| m.contains_key(&id)).unwrap_or(false);
        let expired = CallInFlight::start(Duration::ZERO);
        let id = expired.id;
        drop(expired);
        // Only calls starting and ending, no reading of `in_flight`.
        CallInFlight::start(Duration::from_secs(60)).finished();
        assert!(
            !present(id),
            "an abandoned call the server ended is forgotten"
        );
    }

    #[test]
    fn an_absurd_duration_does_not_overflow_an_instant() {
        let now = Instant::now();
        assert!(later(now, Duration::MAX) > now);
        assert_eq!(
            later(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        let absurd = CallInFlight::start(Duration::MAX);
        let id = absurd.id;
        drop(absurd);
        calls(|m| m.remove(&id));
    }
}
