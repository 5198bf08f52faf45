//! What the kubelet relies on (node-contracts.md): it gives each
//! `NodePrepareResources` / `NodeUnprepareResources` call 45 s
//! (`defaultClientCallTimeout`) and takes responses of 4 MiB at most (grpc-go's
//! default receive limit; tonic's client default is the same 4 MiB, so the
//! fake kubelet below refuses a larger response as the kubelet would).
//!
//! - With the API server hung (the connection accepted, no answer ever),
//!   prepare and unprepare still answer: a claim already prepared from the
//!   checkpoint, any other with a per-claim error naming the API server.
//! - A per-claim error names the claim once, and a claim field longer than
//!   the API server allows gets a short error.
//!
//! The API timeout is configured short here (`PluginConfig::api_timeout`;
//! 10 s by default); the guard around each call is the kubelet's own 45 s.

mod common;

use std::sync::Arc;
use std::time::Duration;

use carve_apiserver::Fault;
use carve_plugin::testing::FakeKubelet;
use carve_plugin::{ClaimRef, Driver, PluginConfig, serve};
use common::*;
use nvidia_ml_sim::GpuEntry;

/// The kubelet's per-call timeout (`defaultClientCallTimeout`).
const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// What the API timeout is configured to in these tests.
const API_TIMEOUT: Duration = Duration::from_millis(300);

/// An "API server" that accepts every TCP connection and never reads or
/// answers: a hung kube-apiserver (or a load balancer in front of a dead
/// one), not a down one (which refuses connections).
struct HungServer {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl HungServer {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((sock, _)) = listener.accept().await {
                held.push(sock);
            }
        });
        Self { url, task }
    }

    fn client(&self) -> kube::Client {
        kube::Client::try_from(kube::Config::new(self.url.parse().unwrap())).unwrap()
    }
}

impl Drop for HungServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A driver served over the real sockets, and a fake kubelet registered with it.
struct Plugin {
    driver: Arc<Driver>,
    kubelet: FakeKubelet,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: Option<carve_plugin::Serving>,
}

impl Plugin {
    async fn start(node: &Node, config: PluginConfig, client: kube::Client) -> Self {
        let driver = Arc::new(Driver::new(config, node.backend(), client).await.unwrap());
        driver.recover().await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let serving = serve(driver.clone(), async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
        let kubelet = FakeKubelet::register(&serving.paths.registration, "gpu.carve.dev")
            .await
            .unwrap();
        Self {
            driver,
            kubelet,
            stop: Some(tx),
            serving: Some(serving),
        }
    }

    /// Prepare as the kubelet does: the call fails the test past 45 s.
    async fn prepare(
        &self,
        claims: &[ClaimRef],
    ) -> carve_proto::dra_v1::NodePrepareResourcesResponse {
        tokio::time::timeout(KUBELET_CALL_TIMEOUT, self.kubelet.prepare(claims))
            .await
            .expect("NodePrepareResources answered within the kubelet's 45 s")
            .unwrap()
    }

    async fn unprepare(
        &self,
        claims: &[ClaimRef],
    ) -> carve_proto::dra_v1::NodeUnprepareResourcesResponse {
        tokio::time::timeout(KUBELET_CALL_TIMEOUT, self.kubelet.unprepare(claims))
            .await
            .expect("NodeUnprepareResources answered within the kubelet's 45 s")
            .unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.serving.take().unwrap().wait().await.unwrap();
    }
}

fn short_timeout(node: &Node) -> PluginConfig {
    let mut c = node.config.clone();
    c.api_timeout = API_TIMEOUT;
    c
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

/// The plugin restarts while the API server hangs: the claim it had
/// prepared answers from the checkpoint (prepare again, then unprepare), a
/// new claim fails with an error naming the API server, and nothing is
/// created for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_api_server_hung_prepared_claims_answer_from_the_checkpoint_and_new_ones_fail_naming_it()
 {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let kept = put_device_claim(&api, "kept", "u-kept", "gpu-0-mig-1g10gb-0");
    let p = Plugin::start(&node, short_timeout(&node), api.client()).await;
    let r = p.prepare(std::slice::from_ref(&kept)).await;
    assert_eq!(r.claims["u-kept"].error, "");
    let devices = r.claims["u-kept"].devices.clone();
    assert_eq!(devices.len(), 1);
    claim_with_status(&api, "kept").await;
    p.stop().await;

    let hung = HungServer::start().await;
    let p = Plugin::start(&node, short_timeout(&node), hung.client()).await;
    let new = put_device_claim(&api, "new", "u-new", "gpu-0-mig-1g10gb-4");
    let r = p.prepare(&[kept.clone(), new.clone()]).await;
    assert_eq!(r.claims["u-kept"].error, "", "answered from the checkpoint");
    assert_eq!(r.claims["u-kept"].devices, devices);
    let e = &r.claims["u-new"].error;
    assert!(r.claims["u-new"].devices.is_empty());
    assert!(
        e.contains("API server: get ResourceClaim: no answer within 300ms"),
        "{e}"
    );
    assert_eq!(count(e, "default/new"), 1, "names the claim once: {e}");
    // Nothing was made or recorded for the failed claim.
    assert_eq!(node.instances().len(), 1);
    let st = p.driver.snapshot().await;
    assert_eq!(st.claims.keys().collect::<Vec<_>>(), ["u-kept"]);

    // Unprepare needs no API server.
    let r = p.unprepare(&[kept.clone(), new.clone()]).await;
    assert_eq!(r.claims["u-kept"].error, "");
    assert_eq!(r.claims["u-new"].error, "");
    assert!(node.instances().is_empty());
    assert!(p.driver.snapshot().await.claims.is_empty());
    p.stop().await;
}

/// The stand-in hangs mid-run (every request delayed by an hour): the
/// status PATCH of a fresh prepare hangs, the next claim's GET hangs. Both
/// calls still answer; the claim prepared before answers again from the
/// checkpoint. Then the server recovers and the failed claim prepares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_hangs_mid_run_bounds_every_call() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let a = put_device_claim(&api, "a", "u-a", "gpu-0-mig-1g10gb-0");
    let b = put_device_claim(&api, "b", "u-b", "gpu-0-mig-1g10gb-4");
    let p = Plugin::start(&node, short_timeout(&node), api.client()).await;
    assert_eq!(
        p.prepare(std::slice::from_ref(&a)).await.claims["u-a"].error,
        ""
    );
    claim_with_status(&api, "a").await;

    // Writes hang: b prepares (its status write hangs in the background),
    // and its unprepare does not wait for that write past its bound.
    api.inject(Fault::DelayNext {
        count: 1000,
        delay: Duration::from_secs(3600),
        writes_only: true,
        resource: None,
    });
    assert_eq!(
        p.prepare(std::slice::from_ref(&b)).await.claims["u-b"].error,
        ""
    );
    assert_eq!(
        p.unprepare(std::slice::from_ref(&b)).await.claims["u-b"].error,
        ""
    );

    // Everything hangs.
    api.clear_faults();
    api.inject(Fault::DelayNext {
        count: 1000,
        delay: Duration::from_secs(3600),
        writes_only: false,
        resource: None,
    });
    let r = p.prepare(&[a.clone(), b.clone()]).await;
    assert_eq!(r.claims["u-a"].error, "");
    let e = &r.claims["u-b"].error;
    assert!(
        e.starts_with("claim default/b (u-b): API server: get ResourceClaim: no answer within"),
        "{e}"
    );
    assert_eq!(node.instances().len(), 1);

    // The server answers again: the same claim prepares.
    api.clear_faults();
    let r = p.prepare(std::slice::from_ref(&b)).await;
    assert_eq!(r.claims["u-b"].error, "");
    let r = p.unprepare(&[a, b]).await;
    assert!(r.claims.values().all(|c| c.error.is_empty()), "{r:?}");
    p.stop().await;
}

/// A claim the API server does not have, named as long as the API server
/// allows: the error names it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_claim_error_names_the_claim_once() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Plugin::start(&node, node.config.clone(), api.client()).await;
    let name = format!("c{}", "x".repeat(carve_plugin::MAX_NAME_LEN - 1));
    let missing = ClaimRef {
        namespace: "default".into(),
        name: name.clone(),
        uid: "u-missing".into(),
    };
    let r = p.prepare(std::slice::from_ref(&missing)).await;
    let e = &r.claims["u-missing"].error;
    assert_eq!(
        e,
        &format!("claim default/{name} (u-missing): ResourceClaim not found")
    );
    assert_eq!(count(e, &name), 1);
    p.stop().await;
}

/// Claims whose fields are longer than any the API server accepts (here a
/// 3 MiB name: the request fits tonic's 4 MiB, an error naming it twice
/// would not) get a short error each, the other claims of the call are
/// served, and the API server is not asked for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_claim_fields_get_a_short_error_and_the_response_stays_small() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let ok = put_device_claim(&api, "ok", "u-ok", "gpu-0-mig-1g10gb-0");
    let p = Plugin::start(&node, node.config.clone(), api.client()).await;
    api.reset_stats();
    let huge = "h".repeat(3 << 20);
    let claims = [
        ClaimRef {
            namespace: "default".into(),
            name: huge.clone(),
            uid: "u-huge-name".into(),
        },
        ClaimRef {
            namespace: huge[..64 << 10].to_string(),
            name: "n".into(),
            uid: "u-huge-ns".into(),
        },
        ok.clone(),
    ];
    let r = p.prepare(&claims).await;
    assert_eq!(r.claims["u-ok"].error, "");
    for (uid, field, len) in [
        ("u-huge-name", "name", 3 << 20),
        ("u-huge-ns", "namespace", 64 << 10),
    ] {
        let e = &r.claims[uid].error;
        assert!(e.len() < 400, "{uid}: {} bytes", e.len());
        assert!(
            e.contains(&format!(
                "field {field} is {len} bytes long, longer than the"
            )),
            "{e}"
        );
        assert_eq!(count(e, &"h".repeat(64)), 1, "{e}");
    }
    // Only the valid claim was read.
    assert_eq!(api.stats().count("get", "resourceclaims"), 1);
    let r = p.unprepare(&claims).await;
    assert_eq!(r.claims["u-ok"].error, "");
    assert!(r.claims["u-huge-name"].error.len() < 400);
    p.stop().await;
}
