//! The HTTP endpoints on `[http] listen`: `GET /metrics` (Prometheus text format),
//! `GET /healthz` (liveness), `GET /readyz` (readiness). Nothing here changes state.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::service::health::Health;

/// Buckets of `timeoutd_dispatch_lateness_seconds`: 1 ms to 10 min.
pub const LATENESS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];
/// Buckets of the claim and confirm durations: 100 µs to 30 s.
pub const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// How often the exporter's upkeep runs, scraped or not: it drains each histogram's recorded
/// samples into its buckets. Without it the samples pile up until the next scrape, and a
/// deployment that scrapes rarely or never grows without bound (issue 25, 8.10).
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

static UPKEEPS: AtomicU64 = AtomicU64::new(0);

/// The exporter's upkeep: histogram samples into their buckets, and the calls-in-flight gauge.
/// Run every [`UPKEEP_EVERY`] by [`serve`] and before each scrape renders.
pub fn upkeep(prometheus: &PrometheusHandle) {
    crate::metrics::calls_in_flight(crate::deadline::in_flight());
    prometheus.run_upkeep();
    UPKEEPS.fetch_add(1, Ordering::Relaxed);
}

/// How many times [`upkeep`] ran in this process.
pub fn upkeeps() -> u64 {
    UPKEEPS.load(Ordering::Relaxed)
}

/// Installs the Prometheus recorder once per process and returns its handle. The recorder is
/// built without the crate's own upkeep task ([`serve`] runs [`upkeep`]).
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full("timeoutd_dispatch_lateness_seconds".into()),
                    LATENESS_BUCKETS,
                )
                .and_then(|b| b.set_buckets(DURATION_BUCKETS));
            let recorder = match builder {
                Ok(b) => b.build_recorder(),
                Err(e) => {
                    tracing::warn!(error = %e, "histogram buckets rejected; using summaries");
                    PrometheusBuilder::new().build_recorder()
                }
            };
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            crate::metrics::describe_all();
            metrics::gauge!(
                "timeoutd_build_info",
                "version" => crate::service::buildinfo::VERSION,
                "revision" => crate::service::buildinfo::REVISION,
            )
            .set(1.0);
            handle
        })
        .clone()
}

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    prometheus: PrometheusHandle,
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(s): State<AppState>) -> Response {
    crate::metrics::ready(s.health.readiness().ready);
    crate::metrics::due_unclaimed(s.health.progress().unclaimed_for());
    upkeep(&s.prometheus);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.prometheus.render(),
    )
        .into_response()
}

async fn healthz(State(s): State<AppState>) -> Response {
    if s.health.is_live() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "dispatch loop stalled\n").into_response()
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    let r = s.health.readiness();
    let code = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(r)).into_response()
}

/// Binds `listen` and returns the bound address (useful with port 0).
pub async fn bind(listen: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// Serves until `stop` is cancelled, and runs the exporter's [`upkeep`] every
/// [`UPKEEP_EVERY`] meanwhile, whether anything scrapes or not.
pub async fn serve(
    listener: TcpListener,
    health: Arc<Health>,
    prometheus: PrometheusHandle,
    stop: CancellationToken,
) {
    let kept = prometheus.clone();
    let state = AppState { health, prometheus };
    let server = axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .into_future();
    let upkeeping = async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            upkeep(&kept);
        }
    };
    let result = tokio::select! {
        result = server => result,
        // The upkeep never ends on its own.
        _ = upkeeping => Ok(()),
    };
    if let Err(e) = result {
        tracing::warn!(error = %e, "HTTP server stopped");
    }
    crate::service::shutdown::stall().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 25, 8.10: the exporter's upkeep (which drains histogram samples into their
    /// buckets) runs while nothing scrapes `/metrics`; before, only a scrape ran it.
    #[tokio::test(start_paused = true)]
    async fn upkeep_runs_without_a_scrape() {
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let (listener, _) = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.unwrap();
        let serving = serve(
            listener,
            Arc::new(Health::new(Duration::from_secs(1))),
            handle,
            CancellationToken::new(),
        );
        let before = upkeeps();
        // Virtual time: three upkeep periods pass at once, and no request is made.
        let three_periods = tokio::time::sleep(UPKEEP_EVERY * 3 + Duration::from_millis(1));
        tokio::select! {
            () = serving => panic!("the server stopped on its own"),
            () = three_periods => {}
        }
        let ran = upkeeps() - before;
        assert!(
            ran >= 3,
            "upkeep ran {ran} times in three periods without a scrape"
        );
    }
}
