//! systemd notifications (`Type=notify`): `READY=1` once MongoDB and RabbitMQ both answer,
//! `WATCHDOG=1` while the dispatch loop is live, `STOPPING=1` at shutdown. Everything here
//! does nothing unless systemd set `NOTIFY_SOCKET` (and `WATCHDOG_USEC` for the watchdog).

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;

use crate::health::Health;

/// How often readiness is checked before `READY=1` is sent.
const READY_CHECK: Duration = Duration::from_millis(100);

/// Sends `READY=1` once the instance is ready, then pets the watchdog at half its period for
/// as long as the dispatch loop is live. A stalled loop stops the petting, and systemd
/// restarts the service after `WatchdogSec`.
pub async fn run(health: Arc<Health>, shutdown: CancellationToken) {
    loop {
        if health.readiness().ready {
            send(&[NotifyState::Ready, NotifyState::Status("dispatching")]);
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(READY_CHECK) => {}
            _ = shutdown.cancelled() => return,
        }
    }
    let Some(period) = sd_notify::watchdog_enabled() else {
        return;
    };
    let mut was_live = true;
    loop {
        let live = health.is_live();
        if live {
            send(&[NotifyState::Watchdog]);
        } else if was_live {
            tracing::error!(watchdog = ?period, "dispatch loop stalled: no longer notifying the systemd watchdog");
        }
        was_live = live;
        tokio::select! {
            _ = tokio::time::sleep(period / 2) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Tells systemd that shutdown has begun.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("draining")]);
}

fn send(state: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "could not notify systemd");
    }
}
