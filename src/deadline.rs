//! Deadlines. Every call to MongoDB or RabbitMQ, connects and closes included, is bounded: a
//! server that stops answering turns into an error the caller handles, never into a wait that
//! holds up the dispatch loop, the reaper or shutdown.

use std::future::Future;
use std::time::Duration;

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
}
