//! systemd notifications (`Type=notify`): `READY=1` once MongoDB and RabbitMQ both answer,
//! `WATCHDOG=1` while the dispatch loop is live, `STOPPING=1` at shutdown. Everything here
//! does nothing unless systemd set `NOTIFY_SOCKET` (and `WATCHDOG_USEC` for the watchdog).

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;

use crate::service::health::Health;

/// How often readiness is checked before `READY=1` is sent.
const READY_CHECK: Duration = Duration::from_millis(100);

/// Sends `READY=1` once the instance is ready, and pets the watchdog at half its period for
/// as long as the dispatch loop is live. A stalled loop stops the petting, and systemd
/// restarts the service after `WatchdogSec`.
pub async fn run(health: Arc<Health>, shutdown: CancellationToken) {
    let watchdog = sd_notify::watchdog_enabled();
    let mut ready = false;
    let mut was_live = true;
    loop {
        if !ready && health.readiness().ready {
            // Sent again at the next check if a send still stuck on the socket skipped it.
            ready = send(&[NotifyState::Ready, NotifyState::Status("dispatching")]).await;
        }
        let live = health.is_live();
        if let Some(period) = watchdog {
            if live {
                send(&[NotifyState::Watchdog]).await;
            } else if was_live {
                tracing::error!(watchdog = ?period, "dispatch loop stalled: no longer notifying the systemd watchdog");
            }
        }
        was_live = live;
        let tick = match (ready, watchdog) {
            (false, _) => READY_CHECK,
            (true, Some(period)) => period / 2,
            (true, None) => {
                // Nothing more to tell systemd until shutdown.
                shutdown.cancelled().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Tells systemd that shutdown has begun.
pub async fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("draining")]).await;
}

/// How long one notification may take. The notify socket is a datagram socket: a receiver
/// that does not read makes a send block once its queue is full.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Sends one notification from a blocking-pool thread, so that a full notify socket can never
/// hold up the daemon's runtime; gives up waiting on it after [`SEND_TIMEOUT`] (the thread
/// still hands it over when the socket takes it). Returns `false` if it was skipped because
/// an earlier send is still stuck on the socket.
async fn send(state: &[NotifyState<'static>]) -> bool {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return true;
    }
    // At most one send at a time: a send stuck on a full socket is not joined by more.
    static SENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SENDING.swap(true, std::sync::atomic::Ordering::AcqRel) {
        tracing::warn!("systemd's notify socket has not taken the last notification; skipping one");
        return false;
    }
    // Cleared when the send ends however it ends: a panic in it, or a closure the blocking
    // pool drops without running (the runtime shutting down), would otherwise leave the flag
    // set and skip every later notification.
    struct Sent;
    impl Drop for Sent {
        fn drop(&mut self) {
            SENDING.store(false, std::sync::atomic::Ordering::Release);
        }
    }
    let sending = Sent;
    let state = state.to_vec();
    let sent = tokio::task::spawn_blocking(move || {
        let _sending = sending;
        sd_notify::notify(&state)
    });
    match tokio::time::timeout(SEND_TIMEOUT, sent).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "could not notify systemd"),
        Ok(Err(e)) => tracing::warn!(error = %e, "could not notify systemd"),
        Err(_) => tracing::warn!("systemd's notify socket did not take a notification in time"),
    }
    true
}
