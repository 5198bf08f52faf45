//! The endpoint over real HTTP on a real socket.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use carve_metrics::{FailureReason, Metrics, MetricsError, ReadyCheck, bind, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

/// One HTTP/1.1 GET; returns (status, content-type, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a full response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let ctype = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (status, ctype, body.to_string())
}

/// Parses exposition lines `name{labels} value` into (series, value).
fn samples(body: &str) -> Vec<(String, f64)> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad line {l:?}"));
            (
                k.to_string(),
                v.parse().unwrap_or_else(|_| panic!("bad value in {l:?}")),
            )
        })
        .collect()
}

fn value(s: &[(String, f64)], series: &str) -> Option<f64> {
    s.iter().find(|(k, _)| k == series).map(|(_, v)| *v)
}

#[tokio::test]
async fn scrape_health_and_readiness_flip() {
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let r = ready.clone();
    let check = ReadyCheck::new(move || {
        let r = r.clone();
        async move {
            if r.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err("not registered with the kubelet yet".into())
            }
        }
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let server = bind(
        "127.0.0.1:0".parse().unwrap(),
        metrics.clone(),
        check,
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    assert_ne!(addr.port(), 0);

    metrics.observe_prepare(Duration::from_millis(20), Ok(()));
    metrics.observe_prepare(
        Duration::from_millis(20),
        Err(FailureReason::PlacementUnavailable),
    );
    metrics.inc_checkpoint_writes();

    let (code, ctype, body) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    let s = samples(&body);
    assert_eq!(
        value(&s, "carve_prepare_duration_seconds_count{result=\"ok\"}"),
        Some(1.0)
    );
    assert_eq!(
        value(
            &s,
            "carve_prepare_errors_total{reason=\"placement_unavailable\"}"
        ),
        Some(1.0)
    );
    assert_eq!(value(&s, "carve_checkpoint_writes_total"), Some(1.0));
    assert_eq!(
        value(&s, "carve_devices_published{type=\"mig\"}"),
        Some(0.0)
    );

    // A later scrape sees later updates.
    metrics.inc_checkpoint_writes();
    let (_, _, body) = get(addr, "/metrics").await;
    assert_eq!(
        value(&samples(&body), "carve_checkpoint_writes_total"),
        Some(2.0)
    );

    assert_eq!(get(addr, "/healthz").await.0, 200);

    let (code, _, body) = get(addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(
        body.contains("not registered with the kubelet yet"),
        "{body}"
    );
    ready.store(true, Ordering::SeqCst);
    assert_eq!(get(addr, "/readyz").await.0, 200);
    ready.store(false, Ordering::SeqCst);
    assert_eq!(get(addr, "/readyz").await.0, 503);

    assert_eq!(get(addr, "/nope").await.0, 404);

    stop.send(()).unwrap();
    server.wait().await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still listening after shutdown"
    );
}

#[tokio::test]
async fn bind_failures_name_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let e = serve(
        addr,
        Arc::new(Metrics::new()),
        ReadyCheck::always(),
        async {},
    )
    .await
    .unwrap_err();
    assert!(matches!(e, MetricsError::Bind { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&addr.to_string()), "{msg}");

    // An address this host does not have (TEST-NET-1).
    let foreign: SocketAddr = "192.0.2.1:9400".parse().unwrap();
    let e = bind(
        foreign,
        Arc::new(Metrics::new()),
        ReadyCheck::always(),
        async {},
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("192.0.2.1:9400"), "{e}");
}

#[tokio::test]
async fn serve_returns_after_shutdown() {
    // The shutdown future is already complete: serve binds, then stops cleanly.
    serve(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(Metrics::new()),
        ReadyCheck::always(),
        async {},
    )
    .await
    .unwrap();
}
