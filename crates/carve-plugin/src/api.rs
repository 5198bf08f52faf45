//! API-server calls on the kubelet's paths, each bounded in time.
//!
//! The kubelet gives a `NodePrepareResources` / `NodeUnprepareResources` call
//! 45 s (`defaultClientCallTimeout`, node-contracts.md) and then gives up on
//! it. The kube client has no read timeout by default (`read_timeout: None`,
//! to keep watches and exec sessions open), so an API server that accepts the
//! connection and never answers would keep a claim GET waiting forever and
//! the kubelet's call unanswered. Every call the plugin makes for a claim
//! goes through [`bounded`]: the wait for one of the driver's API permits
//! and the call itself together get [`crate::PluginConfig::api_timeout`],
//! after which the claim fails with an error naming the API server.

use std::time::Duration;

use tokio::sync::Semaphore;

/// Why an API-server call for a claim failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiFailure {
    /// No answer within the timeout: the API server is hung, overloaded or
    /// unreachable.
    #[error("no answer within {0:?} (the API server is hung, overloaded or unreachable)")]
    Timeout(Duration),
    /// The call failed (connection error, or the server's error status).
    #[error(transparent)]
    Call(#[from] kube::Error),
}

/// Run `call` with one of `permits` held; the wait for the permit and the
/// call together get `timeout`. A closed semaphore (never closed by the
/// driver) runs the call without a permit.
pub(crate) async fn bounded<T>(
    permits: &Semaphore,
    timeout: Duration,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiFailure> {
    let run = async {
        let _permit = permits.acquire().await;
        call.await
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r.map_err(ApiFailure::Call),
        Err(_) => Err(ApiFailure::Timeout(timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(50);

    #[tokio::test]
    async fn a_call_that_never_answers_times_out() {
        let permits = Semaphore::new(1);
        let r: Result<(), _> = bounded(&permits, SHORT, std::future::pending()).await;
        let e = r.unwrap_err();
        assert!(matches!(e, ApiFailure::Timeout(d) if d == SHORT));
        assert!(e.to_string().contains("no answer within 50ms"), "{e}");
        // The permit was given back.
        assert_eq!(permits.available_permits(), 1);
    }

    #[tokio::test]
    async fn the_wait_for_a_permit_counts_against_the_timeout() {
        let permits = Semaphore::new(1);
        let held = permits.acquire().await.unwrap();
        let r = bounded(&permits, SHORT, async { Ok(1) }).await;
        assert!(matches!(r, Err(ApiFailure::Timeout(_))), "{r:?}");
        drop(held);
        let r = bounded(&permits, SHORT, async { Ok(1) }).await;
        assert_eq!(r.unwrap(), 1);
    }
}
