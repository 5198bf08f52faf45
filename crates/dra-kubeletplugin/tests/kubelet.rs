//! The kit serving an example driver over real Unix sockets, called the way
//! the kubelet calls a DRA plugin: registration dialed with the socket path
//! as `:authority` (tonic through the kit's test client, and the real gRPC
//! C-core through Python `grpcio`), then prepare and unprepare over v1 and
//! v1beta1 on `dra.sock`, and the health stream.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use carve_proto::{dra_v1, dra_v1beta1, health_v1alpha1 as hv, registration as reg};
use dra_kubeletplugin::testing::{
    GrpcioReply, grpcio_calls, have_grpcio, kubelet_registration_authorities,
    plain_tonic_registration, registration_channel, uds_channel,
};
use dra_kubeletplugin::{
    Claim, Device, DeviceHealth, DraDriver, HealthStatus, HealthWatch, NotReady, PluginOptions,
    PrepareResult, Serving, UnprepareResult, serve,
};
use prost::Message;
use tokio::sync::watch;
use tokio_stream::StreamExt;

// === The example driver ===

/// Hands out one fake device per claim (`dev-<n>`, CDI id named by the claim
/// UID), refuses claims in namespace `bad`, forgets claims in namespace
/// `lost` (returns no result for them), and can report health.
#[derive(Default)]
struct FakeDriver {
    prepared: std::sync::Mutex<HashMap<String, Device>>,
    health: Option<watch::Receiver<bool>>,
    /// Prepare calls running now, and the most ever at once.
    in_flight: AtomicUsize,
    most: AtomicUsize,
    /// Hold each prepare this long (to widen any overlap).
    hold: Duration,
    stopped: AtomicBool,
}

impl DraDriver for FakeDriver {
    async fn prepare(&self, claims: Vec<Claim>) -> HashMap<String, PrepareResult> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(self.hold).await;
        let mut out = HashMap::new();
        for c in claims {
            let r = match c.namespace.as_str() {
                "bad" => Err(format!("claim {c}: no such device").into()),
                "lost" => continue,
                _ => {
                    let mut p = self.prepared.lock().unwrap();
                    let n = p.len();
                    let dev = p.entry(c.uid.clone()).or_insert_with(|| Device {
                        request_names: vec!["gpu/small".into()],
                        pool_name: "node-a".into(),
                        device_name: format!("dev-{n}"),
                        cdi_device_ids: vec![format!("example.com/dev={}", c.uid)],
                        share_id: Some("share-1".into()),
                    });
                    Ok(vec![dev.clone()])
                }
            };
            out.insert(c.uid, r);
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        out
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> HashMap<String, UnprepareResult> {
        let mut p = self.prepared.lock().unwrap();
        claims
            .into_iter()
            .map(|c| {
                p.remove(&c.uid);
                (c.uid, Ok(()))
            })
            .collect()
    }

    fn health(&self) -> Option<HealthWatch> {
        let rx = self.health.clone()?;
        Some(HealthWatch::new(rx, |ok: &bool| {
            vec![DeviceHealth {
                pool_name: "node-a".into(),
                device_name: "dev-0".into(),
                status: if *ok {
                    HealthStatus::Healthy
                } else {
                    HealthStatus::Unhealthy
                },
                last_updated: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
                message: if *ok {
                    String::new()
                } else {
                    "fan stopped".into()
                },
                check_timeout: None,
            }]
        }))
    }

    async fn stopped(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

// === Harness ===

const DRIVER: &str = "dra.example.com";
const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";
const PREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources";
const UNPREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources";

fn tmp() -> tempfile::TempDir {
    // Short: socket paths must fit sockaddr_un.
    tempfile::Builder::new()
        .prefix("kit")
        .tempdir_in("/tmp")
        .unwrap()
}

fn options(dir: &Path) -> PluginOptions {
    let mut o = PluginOptions::new(DRIVER);
    o.registrar_dir = dir.join("registry");
    o.plugin_data_dir = dir.join("plugins").join(DRIVER);
    o
}

struct Plugin {
    driver: Arc<FakeDriver>,
    serving: Serving,
    stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(driver: FakeDriver, options: PluginOptions) -> Plugin {
    let driver = Arc::new(driver);
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let serving = serve(driver.clone(), options, async move {
        let _ = rx.await;
    })
    .await
    .unwrap();
    Plugin {
        driver,
        serving,
        stop,
    }
}

impl Plugin {
    async fn stop(self) -> Arc<FakeDriver> {
        let paths = self.serving.paths.clone();
        let _ = self.stop.send(());
        self.serving.wait().await.unwrap();
        assert!(self.driver.stopped.load(Ordering::SeqCst), "stopped() ran");
        assert!(!paths.registration.exists() && !paths.dra.exists());
        self.driver
    }
}

/// Register as the kubelet does: GetInfo over the registration socket dialed
/// with the path as `:authority`, then NotifyRegistrationStatus.
async fn register(p: &Plugin) -> reg::PluginInfo {
    let mut r = reg::registration_client::RegistrationClient::new(
        registration_channel(&p.serving.paths.registration)
            .await
            .unwrap(),
    );
    let info = r.get_info(reg::InfoRequest {}).await.unwrap().into_inner();
    r.notify_registration_status(reg::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    info
}

fn claim(ns: &str, uid: &str) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: ns.into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

async fn v1(p: &Plugin) -> dra_v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
    dra_v1::dra_plugin_client::DraPluginClient::new(
        uds_channel(&p.serving.paths.dra).await.unwrap(),
    )
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen"))
}

// === Tests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_driver_registers_prepares_and_unprepares_over_both_versions() {
    let dir = tmp();
    let p = start(FakeDriver::default(), options(dir.path())).await;
    let ready = p.serving.readiness();
    assert!(matches!(ready.check().await, Err(NotReady::NotRegistered)));
    let info = register(&p).await;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, p.serving.paths.dra.to_str().unwrap());
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    assert_eq!(p.serving.registration().status(), Some(Ok(())));
    ready.check().await.unwrap();

    let mut c = v1(&p).await;
    let r = c
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
            claims: vec![claim("ns", "u1"), claim("bad", "u2"), claim("lost", "u3")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims.len(), 3, "every claim gets an answer");
    let ok = &r.claims["u1"];
    assert_eq!(ok.error, "");
    assert_eq!(ok.devices.len(), 1);
    let d = &ok.devices[0];
    assert_eq!(d.request_names, ["gpu"], "subrequest cut off");
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        ("node-a", "dev-0")
    );
    assert_eq!(d.cdi_device_ids, ["example.com/dev=u1"]);
    assert_eq!(d.share_id.as_deref(), Some("share-1"));
    assert_eq!(
        r.claims["u2"].error,
        "claim bad/claim-u2 (u2): no such device"
    );
    assert!(r.claims["u2"].devices.is_empty());
    assert!(
        r.claims["u3"].error.contains("no prepare result") && r.claims["u3"].error.contains("u3"),
        "{}",
        r.claims["u3"].error
    );

    // v1beta1: the same claim, the same device (idempotent), no share id.
    let mut b = dra_v1beta1::dra_plugin_client::DraPluginClient::new(
        uds_channel(&p.serving.paths.dra).await.unwrap(),
    );
    let r = b
        .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest {
            claims: vec![dra_v1beta1::Claim {
                namespace: "ns".into(),
                uid: "u1".into(),
                name: "claim-u1".into(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["u1"].devices[0].device_name, "dev-0");
    assert_eq!(r.claims["u1"].devices[0].request_names, ["gpu"]);

    let r = c
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
            claims: vec![claim("ns", "u1")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["u1"].error, "");
    let driver = p.stop().await;
    assert!(driver.prepared.lock().unwrap().is_empty());
    assert!(
        matches!(ready.check().await, Err(NotReady::Socket { .. })),
        "not ready once stopped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_registration_is_reported_and_not_ready() {
    let dir = tmp();
    let p = start(FakeDriver::default(), options(dir.path())).await;
    let mut status = p.serving.registration();
    let mut r = reg::registration_client::RegistrationClient::new(
        registration_channel(&p.serving.paths.registration)
            .await
            .unwrap(),
    );
    r.notify_registration_status(reg::RegistrationStatus {
        plugin_registered: false,
        error: "versions not supported".into(),
    })
    .await
    .unwrap();
    assert_eq!(
        status.wait().await,
        Err("versions not supported".to_string())
    );
    let e = p.serving.readiness().check().await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "the kubelet rejected the registration: versions not supported"
    );
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_dials_registration_and_dra_sockets_with_every_kubelet_authority() {
    if !have_grpcio() {
        return;
    }
    let dir = tmp();
    let p = start(FakeDriver::default(), options(dir.path())).await;
    let paths = p.serving.paths.clone();
    for authority in kubelet_registration_authorities(&paths.registration) {
        let r = grpcio_calls(
            &paths.registration,
            &authority,
            &[
                (GET_INFO, reg::InfoRequest {}.encode_to_vec()),
                (
                    NOTIFY,
                    reg::RegistrationStatus {
                        plugin_registered: true,
                        error: String::new(),
                    }
                    .encode_to_vec(),
                ),
            ],
        )
        .await
        .unwrap();
        let GrpcioReply::Ok(b) = &r[0] else {
            panic!("GetInfo as {authority}: {:?}", r[0]);
        };
        let info = reg::PluginInfo::decode(b.as_slice()).unwrap();
        assert_eq!(info.name, DRIVER);
        assert!(matches!(r[1], GrpcioReply::Ok(_)), "{:?}", r[1]);
        assert_eq!(p.serving.registration().status(), Some(Ok(())));
    }
    let [encoded, raw] = kubelet_registration_authorities(&paths.dra);
    for (i, authority) in ["localhost".to_string(), encoded, raw].iter().enumerate() {
        let uid = format!("g{i}");
        let c = claim("ns", &uid);
        let r = grpcio_calls(
            &paths.dra,
            authority,
            &[
                (
                    PREPARE,
                    dra_v1::NodePrepareResourcesRequest {
                        claims: vec![c.clone()],
                    }
                    .encode_to_vec(),
                ),
                (
                    UNPREPARE,
                    dra_v1::NodeUnprepareResourcesRequest { claims: vec![c] }.encode_to_vec(),
                ),
            ],
        )
        .await
        .unwrap();
        let GrpcioReply::Ok(b) = &r[0] else {
            panic!("prepare as {authority}: {:?}", r[0]);
        };
        let prep = dra_v1::NodePrepareResourcesResponse::decode(b.as_slice()).unwrap();
        assert_eq!(prep.claims[&uid].error, "", "prepare as {authority}");
        assert_eq!(prep.claims[&uid].devices.len(), 1);
        let GrpcioReply::Ok(b) = &r[1] else {
            panic!("unprepare as {authority}: {:?}", r[1]);
        };
        let un = dra_v1::NodeUnprepareResourcesResponse::decode(b.as_slice()).unwrap();
        assert_eq!(un.claims[&uid].error, "", "unprepare as {authority}");
    }
    p.stop().await;
}

/// Control: the grpcio client really sends what h2 rejects. A plain tonic
/// server resets GetInfo for both kubelet authorities and answers `localhost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tonic_server_rejects_the_kubelets_registration_dial() {
    if !have_grpcio() {
        return;
    }
    let dir = tmp();
    let (sock, _stop) = plain_tonic_registration(dir.path()).await;
    for authority in kubelet_registration_authorities(&sock) {
        let r = grpcio_calls(&sock, &authority, &[(GET_INFO, vec![])])
            .await
            .unwrap();
        match &r[0] {
            GrpcioReply::Failed { code, details } => {
                assert_eq!(code, "INTERNAL", "{authority}: {details}");
                assert!(details.contains("RST_STREAM"), "{authority}: {details}");
            }
            GrpcioReply::Ok(_) => panic!("plain tonic accepted :authority {authority}"),
        }
    }
    let r = grpcio_calls(&sock, "localhost", &[(GET_INFO, vec![])])
        .await
        .unwrap();
    let GrpcioReply::Ok(b) = &r[0] else {
        panic!("GetInfo as localhost: {:?}", r[0]);
    };
    let info = reg::PluginInfo::decode(b.as_slice()).unwrap();
    assert_eq!(info.name, "gpu.carve.dev");
}

/// Control for the tonic test client: a plain tonic server rejects its
/// registration dial as it rejects the kubelet's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_registration_client_is_rejected_where_the_kubelet_is() {
    let dir = tmp();
    let (sock, _stop) = plain_tonic_registration(dir.path()).await;
    let mut r = reg::registration_client::RegistrationClient::new(
        registration_channel(&sock).await.unwrap(),
    );
    let e = r.get_info(reg::InfoRequest {}).await.unwrap_err();
    assert!(e.to_string().contains("PROTOCOL_ERROR"), "{e}");
}

#[test]
fn the_registration_authority_is_the_path_as_grpc_go_encodes_it() {
    // carve's shared/reference/node-contracts.md §1, as grpc-go sends it.
    assert_eq!(
        dra_kubeletplugin::testing::grpc_go_authority(Path::new(
            "/var/lib/kubelet/plugins_registry/gpu.carve.dev-reg.sock"
        )),
        "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.carve.dev-reg.sock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_streamed_on_change_and_resent_and_ends_at_shutdown() {
    let dir = tmp();
    let (tx, rx) = watch::channel(true);
    let mut o = options(dir.path());
    o.health_resend = None;
    let p = start(
        FakeDriver {
            health: Some(rx),
            ..FakeDriver::default()
        },
        o,
    )
    .await;
    assert_eq!(
        register(&p).await.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    let mut c = hv::dra_resource_health_client::DraResourceHealthClient::new(
        uds_channel(&p.serving.paths.dra).await.unwrap(),
    );
    let mut w = c
        .node_watch_resources(hv::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let rows = |m: hv::NodeWatchResourcesResponse| -> Vec<(String, i32, String, i64)> {
        m.devices
            .into_iter()
            .map(|d| {
                let id = d.device.unwrap();
                assert_eq!(id.pool_name, "node-a");
                (id.device_name, d.health, d.message, d.last_updated_time)
            })
            .collect()
    };
    let first = rows(within("first", w.next()).await.unwrap().unwrap());
    assert_eq!(
        first,
        [(
            "dev-0".to_string(),
            hv::HealthStatus::Healthy as i32,
            String::new(),
            1_800_000_000
        )]
    );
    tx.send_replace(false);
    let second = rows(within("change", w.next()).await.unwrap().unwrap());
    assert_eq!(second[0].1, hv::HealthStatus::Unhealthy as i32);
    assert_eq!(second[0].2, "fan stopped");
    p.stop().await;
    assert!(
        within("stream end", w.next()).await.is_none(),
        "health stream ends at shutdown"
    );
    drop(tx);

    // Resent without a change, stamped with the driver's last check.
    let (tx, rx) = watch::channel(true);
    let mut o = options(dir.path());
    o.health_resend = Some(Duration::from_millis(20));
    let checked = SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000);
    struct Checked(FakeDriver, SystemTime);
    impl DraDriver for Checked {
        async fn prepare(&self, c: Vec<Claim>) -> HashMap<String, PrepareResult> {
            self.0.prepare(c).await
        }
        async fn unprepare(&self, c: Vec<Claim>) -> HashMap<String, UnprepareResult> {
            self.0.unprepare(c).await
        }
        fn health(&self) -> Option<HealthWatch> {
            let t = self.1;
            Some(self.0.health()?.with_last_check(move || t))
        }
    }
    let d = Arc::new(Checked(
        FakeDriver {
            health: Some(rx),
            ..FakeDriver::default()
        },
        checked,
    ));
    let (stop, srx) = tokio::sync::oneshot::channel::<()>();
    let serving = serve(d, o, async move {
        let _ = srx.await;
    })
    .await
    .unwrap();
    let mut c = hv::dra_resource_health_client::DraResourceHealthClient::new(
        uds_channel(&serving.paths.dra).await.unwrap(),
    );
    let mut w = c
        .node_watch_resources(hv::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        let r = rows(within("resend", w.next()).await.unwrap().unwrap());
        assert_eq!(r[0].1, hv::HealthStatus::Healthy as i32);
        assert_eq!(r[0].3, 1_900_000_000);
    }
    // The driver's watch closes: the stream ends.
    drop(tx);
    assert!(within("closed source", w.next()).await.is_none());
    let _ = stop.send(());
    serving.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_health_or_v1beta1_neither_is_advertised_nor_served() {
    let dir = tmp();
    let mut o = options(dir.path());
    o.v1beta1 = false;
    let p = start(FakeDriver::default(), o).await;
    assert_eq!(register(&p).await.supported_versions, ["v1.DRAPlugin"]);
    let mut h = hv::dra_resource_health_client::DraResourceHealthClient::new(
        uds_channel(&p.serving.paths.dra).await.unwrap(),
    );
    let e = h
        .node_watch_resources(hv::NodeWatchResourcesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e}");
    let mut b = dra_v1beta1::dra_plugin_client::DraPluginClient::new(
        uds_channel(&p.serving.paths.dra).await.unwrap(),
    );
    let e = b
        .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest { claims: vec![] })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e}");
    p.stop().await;
}

/// Rolling update: two plugin pods of one driver (own UIDs, one data
/// directory) serve at once under their own sockets, and their calls take
/// turns through `serialize.lock`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_of_a_rolling_update_serve_side_by_side_and_take_turns() {
    let dir = tmp();
    let shared = Arc::new(FakeDriver {
        hold: Duration::from_millis(20),
        ..FakeDriver::default()
    });
    let mut servings = Vec::new();
    for uid in ["old-pod", "new-pod"] {
        let mut o = options(dir.path());
        o.rolling_update_uid = Some(uid.into());
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let s = serve(shared.clone(), o, async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
        assert!(
            s.paths
                .registration
                .ends_with(format!("{DRIVER}-{uid}-reg.sock"))
        );
        assert!(s.paths.dra.ends_with(format!("dra-{uid}.sock")));
        servings.push((s, stop));
    }
    // Each server has its own in-process lock: only the file lock can keep
    // calls through different servers from overlapping.
    let mut calls = Vec::new();
    for i in 0..6 {
        let path = servings[i % 2].0.paths.dra.clone();
        calls.push(tokio::spawn(async move {
            let mut c =
                dra_v1::dra_plugin_client::DraPluginClient::new(uds_channel(&path).await.unwrap());
            c.node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: vec![claim("ns", &format!("r{i}"))],
            })
            .await
            .unwrap()
            .into_inner()
        }));
    }
    for c in calls {
        let r = c.await.unwrap();
        assert!(r.claims.values().all(|c| c.error.is_empty()), "{r:?}");
    }
    assert_eq!(shared.most.load(Ordering::SeqCst), 1, "calls overlapped");
    assert!(
        dir.path()
            .join("plugins")
            .join(DRIVER)
            .join("serialize.lock")
            .exists()
    );
    for (s, stop) in servings {
        let _ = stop.send(());
        s.wait().await.unwrap();
    }
}

/// Without serialization the driver gets concurrent calls: two prepares
/// that each wait for the other complete only if they run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_serialization_off_calls_run_concurrently() {
    struct Meet(tokio::sync::Barrier);
    impl DraDriver for Meet {
        async fn prepare(&self, c: Vec<Claim>) -> HashMap<String, PrepareResult> {
            self.0.wait().await;
            c.into_iter().map(|c| (c.uid, Ok(vec![]))).collect()
        }
        async fn unprepare(&self, c: Vec<Claim>) -> HashMap<String, UnprepareResult> {
            c.into_iter().map(|c| (c.uid, Ok(()))).collect()
        }
    }
    let dir = tmp();
    let mut o = options(dir.path());
    o.serialize = false;
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let s = serve(
        Arc::new(Meet(tokio::sync::Barrier::new(2))),
        o,
        async move {
            let _ = rx.await;
        },
    )
    .await
    .unwrap();
    let call = |uid: &'static str| {
        let path = s.paths.dra.clone();
        async move {
            let mut c =
                dra_v1::dra_plugin_client::DraPluginClient::new(uds_channel(&path).await.unwrap());
            c.node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: vec![claim("ns", uid)],
            })
            .await
            .unwrap()
            .into_inner()
        }
    };
    let (a, b) = within("both prepares", async {
        tokio::join!(call("a"), call("b"))
    })
    .await;
    assert_eq!(a.claims["a"].error, "");
    assert_eq!(b.claims["b"].error, "");
    let _ = stop.send(());
    s.wait().await.unwrap();
}

#[tokio::test]
async fn bad_options_are_refused_and_nothing_is_bound() {
    let dir = tmp();
    let mut o = options(dir.path());
    o.driver_name = String::new();
    let e = serve(Arc::new(FakeDriver::default()), o, async {})
        .await
        .unwrap_err();
    assert!(e.to_string().contains("driver_name"), "{e}");
    assert!(!dir.path().join("registry").exists());
    // A registration directory that cannot be made: the DRA socket is
    // removed again.
    let mut o = options(dir.path());
    std::fs::write(dir.path().join("file"), b"").unwrap();
    o.registrar_dir = dir.path().join("file").join("sub");
    let e = serve(Arc::new(FakeDriver::default()), o.clone(), async {})
        .await
        .unwrap_err();
    assert!(e.to_string().contains("creating socket directory"), "{e}");
    assert!(!o.socket_paths().unwrap().dra.exists());
}
