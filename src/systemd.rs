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

/// Sends `READY=1` once the instance is ready, and pets the watchdog at half its period for
/// as long as the dispatch loop is live. A stalled loop stops the petting, and systemd
/// restarts the service after `WatchdogSec`.
pub async fn run(health: Arc<Health>, shutdown: CancellationToken) {
    let watchdog = sd_notify::watchdog_enabled();
    let mut ready = false;
    let mut was_live = true;
    loop {
        if !ready && health.readiness().ready {
            send(&[NotifyState::Ready, NotifyState::Status("dispatching")]);
            ready = true;
        }
        let live = health.is_live();
        if let Some(period) = watchdog {
            if live {
                send(&[NotifyState::Watchdog]);
            } else if was_live {
                tracing::error!(watchdog = ?period, "dispatch loop stalled: no longer notifying the systemd watchdog");
            }
        }
        was_live = live;
        let tick = match (ready, watchdog) {
            (false, _) => READY_CHECK,
            (true, Some(period)) => period / 2,
            (true, None) => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
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
