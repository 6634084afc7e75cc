//! The HTTP endpoints on `[http] listen`: `GET /metrics` (Prometheus text format),
//! `GET /healthz` (liveness), `GET /readyz` (readiness). Nothing here changes state.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

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

/// Installs the Prometheus recorder once per process and returns its handle.
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
    crate::metrics::calls_in_flight(crate::deadline::in_flight());
    s.prometheus.run_upkeep();
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

/// Serves until `stop` is cancelled.
pub async fn serve(
    listener: TcpListener,
    health: Arc<Health>,
    prometheus: PrometheusHandle,
    stop: CancellationToken,
) {
    let state = AppState { health, prometheus };
    let result = axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await;
    if let Err(e) = result {
        tracing::warn!(error = %e, "HTTP server stopped");
    }
    crate::service::shutdown::stall().await;
}
