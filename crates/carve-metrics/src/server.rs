//! The HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::task::JoinHandle;

use crate::error::MetricsError;
use crate::metrics::{Metrics, OPENMETRICS_CONTENT_TYPE};

/// How long `/readyz` waits for the readiness check before answering 503.
const READY_TIMEOUT: Duration = Duration::from_secs(5);

type BoxedCheck =
    dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync;

/// The readiness check `/readyz` runs on every request: `Ok(())` means ready,
/// `Err(reason)` is answered as 503 with the reason as body. For the plugin:
/// "registered with the kubelet and the DRA socket answers".
#[derive(Clone)]
pub struct ReadyCheck(Arc<BoxedCheck>);

impl fmt::Debug for ReadyCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReadyCheck(..)")
    }
}

impl ReadyCheck {
    /// A check from an async closure.
    pub fn new<F, Fut>(check: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        ReadyCheck(Arc::new(move || Box::pin(check())))
    }

    /// A check that always passes (for processes with nothing to wait for).
    #[must_use]
    pub fn always() -> Self {
        ReadyCheck::new(|| async { Ok(()) })
    }

    /// Runs the check.
    ///
    /// # Errors
    /// The check's reason for not being ready.
    pub async fn check(&self) -> Result<(), String> {
        (self.0)().await
    }
}

#[derive(Clone, Debug)]
struct AppState {
    metrics: Arc<Metrics>,
    ready: ReadyCheck,
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        s.metrics.encode(),
    )
        .into_response()
}

/// Liveness: answering at all shows the process and its runtime are alive.
async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<AppState>) -> Response {
    match tokio::time::timeout(READY_TIMEOUT, s.ready.check()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n").into_response(),
        Ok(Err(reason)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: readiness check did not answer within {}s\n",
                READY_TIMEOUT.as_secs()
            ),
        )
            .into_response(),
    }
}

fn router(metrics_: Arc<Metrics>, ready: ReadyCheck) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            metrics: metrics_,
            ready,
        })
}

/// A running endpoint started by [`bind`].
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl MetricsServer {
    /// The address actually bound (the real port when asked for port 0).
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until the server stopped after its shutdown future completed.
    ///
    /// # Errors
    /// The server failed, or its task panicked.
    pub async fn wait(self) -> Result<(), MetricsError> {
        let addr = self.addr;
        match self.task.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(MetricsError::Serve { addr, source }),
            Err(e) => Err(MetricsError::Task {
                addr,
                reason: e.to_string(),
            }),
        }
    }
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` on a spawned
/// task until `shutdown` completes; returns once the socket is listening, so
/// connections made after this returns are answered.
///
/// # Errors
/// [`MetricsError::Bind`] naming the address.
pub async fn bind(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: ReadyCheck,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<MetricsServer, MetricsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let app = router(metrics, ready);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    });
    tracing::info!(addr = %bound, "metrics endpoint listening");
    Ok(MetricsServer { addr: bound, task })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until `shutdown`
/// completes. Use [`bind`] to learn the port when `addr` has port 0.
///
/// # Errors
/// [`MetricsError::Bind`] naming the address, or a serving failure.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: ReadyCheck,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MetricsError> {
    bind(addr, metrics, ready, shutdown).await?.wait().await
}
