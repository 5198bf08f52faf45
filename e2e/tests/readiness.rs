//! The real `carve kubelet-plugin` binary's `/readyz` and `/healthz` (what
//! the chart's probes call): not ready until the kubelet has registered the
//! plugin, ready after, and the reason named while not ready.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use carve_apiserver::{ApiServer, Options};
use carve_e2e::{SimNode, carve_binary, wait_for};
use carve_plugin::testing::FakeKubelet;
use nvidia_ml_sim::GpuEntry;

/// The metrics address the plugin logged (`serving the kubelet …
/// metrics_addr=127.0.0.1:N`).
fn metrics_addr(log: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|l| l.contains("serving the kubelet"))?;
    let rest = line.split("metrics_addr=").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// `GET path`: the status code and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {out}"));
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_is_ready_only_once_the_kubelet_registered_it() {
    let carve = carve_binary().unwrap_or_else(|e| panic!("{e}"));
    let api = ApiServer::start(Options::default()).await.unwrap();
    let mut node = SimNode::new(
        "node-r",
        vec![GpuEntry::new("h100-80gb", 1, true)],
        carve,
        &api.url(),
    )
    .unwrap();
    let reg = node.start_plugin().await.unwrap_or_else(|e| panic!("{e}"));
    let addr = wait_for(&mut node, "the plugin's metrics address", |n| {
        metrics_addr(&n.log())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let (code, body) = get(addr, "/healthz");
    assert_eq!(code, 200, "{body}");
    let (code, body) = get(addr, "/readyz");
    assert_eq!(code, 503, "ready before the kubelet registered it: {body}");
    assert!(
        body.contains("not registered with the kubelet yet"),
        "{body}"
    );

    let _kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
    let (code, body) = get(addr, "/readyz");
    assert_eq!(
        code,
        200,
        "not ready after registration: {body}\n{}",
        node.log()
    );
}
