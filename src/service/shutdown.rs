//! Shutdown: SIGTERM or SIGINT cancels one [`CancellationToken`] that every task watches.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

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
