//! The plugin's sockets dialed exactly as the kubelet dials them, by a real
//! gRPC client: Python `grpcio` (gRPC C-core), through the kit's
//! `dra_kubeletplugin::testing::grpcio_calls`.
//!
//! The kubelet's plugin watcher dials `<name>-reg.sock` with grpc-go and the
//! bare socket path, so the HTTP/2 `:authority` is the path percent-encoded
//! (older grpc-go: the raw path); `dra.sock` is dialed as `unix:<path>`, which
//! sends `localhost` (`../shared/reference/node-contracts.md` §1). A plain
//! tonic server resets the first two (`RST_STREAM PROTOCOL_ERROR`, h2's
//! authority check); the kit's control test
//! (`dra-kubeletplugin/tests/kubelet.rs`,
//! `a_plain_tonic_server_rejects_the_kubelets_registration_dial`) shows that
//! this client really sends them, so the plugin's tests cannot pass by a
//! client that sends something easier.
//!
//! The requests are serialized here by prost from carve-proto's types and sent
//! as raw bytes through grpcio's generic unary calls.
//!
//! Needs `python3` with `grpcio` (`.ci/run` installs it): without it the tests
//! skip, printing why, except under `CI=true`, where they fail.

mod common;

use std::path::Path;
use std::sync::Arc;

use carve_apiserver::ApiServer;
use carve_plugin::testing::FakeKubelet;
use carve_plugin::{Driver, Serving, serve};
use carve_proto::{dra_v1, registration as reg};
use common::*;
use dra_kubeletplugin::testing::{
    GrpcioReply, grpcio_calls, have_grpcio,
    kubelet_registration_authorities as kubelet_authorities, plain_tonic_registration,
};
use nvidia_ml_sim::GpuEntry;
use prost::Message;

const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";
const PREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources";
const UNPREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources";

/// A call's reply decoded, or the test fails naming `what`.
fn decode<M: Message + Default>(r: &GrpcioReply, what: &str) -> M {
    match r {
        GrpcioReply::Ok(b) => M::decode(b.as_slice()).unwrap(),
        GrpcioReply::Failed { code, details } => panic!("{what}: {code}: {details}"),
    }
}

/// Dial `socket` once with `authority` as `:authority` and make `calls`
/// (method, request) in order on that one connection.
async fn grpcio(socket: &Path, authority: &str, calls: &[(&str, Vec<u8>)]) -> Vec<GrpcioReply> {
    grpcio_calls(socket, authority, calls).await.unwrap()
}

struct Plugin {
    _node: Node,
    api: ApiServer,
    serving: Option<Serving>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Plugin {
    async fn start() -> Self {
        let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
        let api = api().await;
        let driver = Arc::new(
            Driver::new(node.config.clone(), node.backend(), api.client())
                .await
                .unwrap(),
        );
        driver.recover().await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let serving = serve(driver, async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
        Self {
            _node: node,
            api,
            serving: Some(serving),
            stop: Some(tx),
        }
    }

    fn serving(&self) -> &Serving {
        self.serving.as_ref().unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.serving.take().unwrap().wait().await.unwrap();
    }
}

fn notify(registered: bool, error: &str) -> Vec<u8> {
    reg::RegistrationStatus {
        plugin_registered: registered,
        error: error.into(),
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_answers_the_kubelets_dial_with_encoded_and_raw_path_authority() {
    if !have_grpcio() {
        return;
    }
    let p = Plugin::start().await;
    let paths = p.serving().paths.clone();
    for authority in kubelet_authorities(&paths.registration) {
        let mut status = p.serving().registration();
        // One connection, as the kubelet's: GetInfo, then a rejection, then
        // the acceptance (the kubelet re-validates and notifies again).
        let r = grpcio(
            &paths.registration,
            &authority,
            &[
                (GET_INFO, reg::InfoRequest {}.encode_to_vec()),
                (NOTIFY, notify(false, "versions not supported")),
            ],
        )
        .await;
        let info: reg::PluginInfo = decode(&r[0], &format!("GetInfo as {authority}"));
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpu.carve.dev");
        // The endpoint the kubelet dials on the host: the DRA socket's path.
        assert_eq!(info.endpoint, paths.dra.to_str().unwrap());
        assert!(Path::new(&info.endpoint).is_absolute());
        assert_eq!(
            info.supported_versions,
            ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        );
        let _: reg::RegistrationStatusResponse = decode(&r[1], "NotifyRegistrationStatus(false)");
        assert_eq!(
            status.wait().await,
            Err("versions not supported".to_string())
        );
        let r = grpcio(
            &paths.registration,
            &authority,
            &[(NOTIFY, notify(true, ""))],
        )
        .await;
        let _: reg::RegistrationStatusResponse = decode(&r[0], "NotifyRegistrationStatus(true)");
        assert_eq!(p.serving().registration().status(), Some(Ok(())));
    }
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_socket_prepares_and_unprepares_for_the_kubelets_dial() {
    if !have_grpcio() {
        return;
    }
    let p = Plugin::start().await;
    let dra = p.serving().paths.dra.clone();
    let [encoded, raw] = kubelet_authorities(&dra);
    // `localhost` is what the kubelet sends here; any authority is accepted.
    for (i, authority) in ["localhost".to_string(), encoded, raw]
        .into_iter()
        .enumerate()
    {
        let uid = format!("uid-{i}");
        let c = put_device_claim(&p.api, &format!("c{i}"), &uid, "gpu-0-mig-1g10gb-2");
        let claim = dra_v1::Claim {
            namespace: c.namespace.clone(),
            uid: c.uid.clone(),
            name: c.name.clone(),
        };
        let r = grpcio(
            &dra,
            &authority,
            &[
                (
                    PREPARE,
                    dra_v1::NodePrepareResourcesRequest {
                        claims: vec![claim.clone()],
                    }
                    .encode_to_vec(),
                ),
                (
                    UNPREPARE,
                    dra_v1::NodeUnprepareResourcesRequest {
                        claims: vec![claim],
                    }
                    .encode_to_vec(),
                ),
            ],
        )
        .await;
        let prep: dra_v1::NodePrepareResourcesResponse =
            decode(&r[0], &format!("prepare as {authority}"));
        let cr = &prep.claims[&uid];
        assert_eq!(cr.error, "", "prepare as {authority}");
        assert_eq!(cr.devices.len(), 1);
        assert_eq!(cr.devices[0].device_name, "gpu-0-mig-1g10gb-2");
        let un: dra_v1::NodeUnprepareResourcesResponse =
            decode(&r[1], &format!("unprepare as {authority}"));
        assert_eq!(un.claims[&uid].error, "", "unprepare as {authority}");
    }
    p.stop().await;
}

/// The fake kubelet that the e2e suites use dials as the kubelet does: a
/// plain tonic server rejects it as it rejects the kubelet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_kubelet_is_rejected_where_the_kubelet_is() {
    let dir = tempfile::Builder::new()
        .prefix("kd")
        .tempdir_in("/tmp")
        .unwrap();
    let (sock, _stop) = plain_tonic_registration(dir.path()).await;
    let err = FakeKubelet::register(&sock, "gpu.carve.dev")
        .await
        .expect_err("a plain tonic server must reject the kubelet's dial");
    let msg = err.to_string();
    assert!(
        msg.contains("GetInfo") && msg.contains("PROTOCOL_ERROR"),
        "{msg}"
    );
}

/// The fake kubelet registers with carve's plugin and prepares through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_kubelet_registers_with_the_plugin() {
    let p = Plugin::start().await;
    let k = FakeKubelet::register(&p.serving().paths.registration, "gpu.carve.dev")
        .await
        .unwrap();
    assert_eq!(k.info.endpoint, p.serving().paths.dra.to_str().unwrap());
    assert_eq!(p.serving().registration().status(), Some(Ok(())));
    let c = put_device_claim(&p.api, "c", "u", "gpu-0-mig-1g10gb-2");
    let r = k.prepare(std::slice::from_ref(&c)).await.unwrap();
    assert_eq!(r.claims["u"].error, "");
    let r = k.unprepare(std::slice::from_ref(&c)).await.unwrap();
    assert_eq!(r.claims["u"].error, "");
    p.stop().await;
}
