//! Shutdown: SIGTERM or SIGINT cancels one [`CancellationToken`] that every task watches.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// How long after `shutdown_timeout` the daemon may take, in all, after a SIGTERM: for the
/// dispatch loop's removals and releases, the HTTP endpoints and closing the MongoDB client.
/// The dispatch loop gives its removals until half of it.
pub const GRACE: Duration = Duration::from_secs(5);

/// How long the process's end waits for blocking calls still running once the work has
/// ended (each already bounded by its caller, who stopped waiting for it).
pub const EXIT_WAIT: Duration = Duration::from_secs(1);

/// Runs `main` on `runtime` to its end, then ends the runtime, waiting at most [`EXIT_WAIT`]
/// for blocking calls still running: a systemd notification stuck on a full notify socket
/// ([`crate::service::systemd`] gives up on it after a second, the thread stays), a DNS
/// lookup. Dropping the runtime waited for them without end, after the daemon had met its
/// shutdown deadline.
pub fn run_to_end<F: std::future::Future>(runtime: tokio::runtime::Runtime, main: F) -> F::Output {
    let out = runtime.block_on(main);
    runtime.shutdown_timeout(EXIT_WAIT);
    out
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// A blocking call that never returns on its own (a notification stuck on a full socket)
    /// does not keep the process from ending.
    #[test]
    fn the_end_does_not_wait_for_a_stuck_blocking_call() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let (ended, end) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let out = run_to_end(runtime, async move {
                let (started, running) = tokio::sync::oneshot::channel();
                drop(tokio::task::spawn_blocking(move || {
                    let _ = started.send(());
                    stuck.recv()
                }));
                running.await.expect("the blocking call started");
                7
            });
            let _ = ended.send(out);
        });
        // Far beyond EXIT_WAIT: only an end that waits for the call misses it.
        let out = end.recv_timeout(Duration::from_secs(60));
        let _ = release.send(());
        assert_eq!(out, Ok(7), "the runtime's end waited for the blocking call");
    }
}
