//! Shutdown: SIGTERM or SIGINT cancels one [`CancellationToken`] that every task watches.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// How long after `shutdown_timeout` the daemon may take, in all, after a SIGTERM: for the
/// dispatch loop's removals and releases, the HTTP endpoints and closing the MongoDB client.
/// The dispatch loop gives its removals until half of it.
pub const GRACE: Duration = Duration::from_secs(5);

/// Waits for SIGTERM or SIGINT, then cancels `token`. Returns the signal's name.
pub async fn on_signal(token: CancellationToken) -> std::io::Result<&'static str> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
        _ = token.cancelled() => "cancelled",
    };
    token.cancel();
    Ok(name)
}

/// Tests only (`shutdown-stall=return(MS)`): a step of the shutdown that takes MS (a client
/// close, a task's end), to show that all of them share one deadline.
pub async fn stall() {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval("shutdown-stall", |arg| {
        arg.and_then(|a| a.parse::<u64>().ok())
    }) {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}
