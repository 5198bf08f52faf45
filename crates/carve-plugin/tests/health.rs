//! GPU health end to end: the real `NvmlBackend` over the NVML simulator
//! receives injected XID events, the `HealthMonitor` folds them, and a fake
//! kubelet watches `v1alpha1.DRAResourceHealth/NodeWatchResources` over the real
//! `dra.sock`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use carve_gpu::{GpuBackend, GpuEvents};
use carve_model::health::{GPU_LOST_TAINT_KEY, HealthStatus, XID_TAINT_KEY};
use carve_model::{DeviceName, GpuModel};
use carve_nvml::{NvmlBackend, NvmlOptions};
use carve_plugin::health::{
    HealthHandle, HealthMonitor, HealthOptions, HealthSnapshot, ServeOptions, serve_with,
};
use carve_plugin::testing::{FakeKubelet, uds_channel};
use carve_plugin::{Driver, Serving, serve};
use carve_proto::health_v1alpha1 as hv;
use common::*;
use nvidia_ml_sim::{Fault, FaultAction, GpuEntry, SimEvent, inject_event, simulate_gpu_reset};
use tokio_stream::StreamExt;

/// Long enough never to pass in a test: rounds end on injected events.
const LONG_POLL: Duration = Duration::from_secs(30);

/// `f`, or a test failure (instead of a hang) when it never completes.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen"))
}

fn open(node: &Node) -> Arc<NvmlBackend> {
    Arc::new(
        NvmlBackend::open(NvmlOptions {
            lib_path: Some(node.lib.clone()),
            proc_root: node.sim.proc_root.clone(),
        })
        .unwrap(),
    )
}

/// Every device a node of `gpus` H100s publishes here: each GPU, its MPS
/// variant, and every MIG placement of every profile.
fn devices(gpus: u32) -> Vec<DeviceName> {
    let spec = GpuModel::find("h100-80gb").unwrap().spec();
    let mut v = Vec::new();
    for g in 0..gpus {
        v.push(format!("gpu-{g}").parse().unwrap());
        v.push(format!("gpu-{g}-mps").parse().unwrap());
        for p in &spec.profiles {
            for pl in &p.placements {
                v.push(DeviceName::mig(g, &p.name, pl.start).unwrap());
            }
        }
    }
    v
}

type Watch = tonic::Streaming<hv::NodeWatchResourcesResponse>;

async fn watch(serving: &Serving) -> Watch {
    let mut c = hv::dra_resource_health_client::DraResourceHealthClient::new(
        uds_channel(&serving.paths.dra).await.unwrap(),
    );
    c.node_watch_resources(hv::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// The next message, as (device, health, message) rows.
async fn next(w: &mut Watch) -> Vec<(String, hv::HealthStatus, String)> {
    let m = within("next health message", w.next())
        .await
        .expect("stream open")
        .expect("message");
    m.devices
        .iter()
        .map(|d| {
            let id = d.device.as_ref().unwrap();
            assert_eq!(id.pool_name, NODE, "{id:?}");
            assert!(d.last_updated_time > 1_700_000_000, "{d:?}");
            assert!(d.message.chars().count() <= 1024);
            (
                id.device_name.clone(),
                hv::HealthStatus::try_from(d.health).unwrap(),
                d.message.clone(),
            )
        })
        .collect()
}

fn unhealthy(rows: &[(String, hv::HealthStatus, String)]) -> Vec<String> {
    rows.iter()
        .filter(|r| r.1 != hv::HealthStatus::Healthy)
        .map(|r| r.0.clone())
        .collect()
}

fn names(devs: &[DeviceName]) -> Vec<String> {
    devs.iter().map(ToString::to_string).collect()
}

/// Stop the monitor, waking its NVML wait with an ignored event.
async fn stop_monitor(h: &HealthHandle, node: &Node) {
    let both = async {
        tokio::join!(h.stop(), async {
            inject_event(&node.sim, &SimEvent::xid(0, 13)).unwrap();
        })
    };
    let (r, ()) = within("monitor stop", both).await;
    r.unwrap();
}

struct Plugin {
    driver: Arc<Driver>,
    health: HealthHandle,
    serving: Serving,
    kubelet: FakeKubelet,
    stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(
    node: &Node,
    api: &carve_apiserver::ApiServer,
    backend: &Arc<NvmlBackend>,
    resend: Option<Duration>,
) -> Plugin {
    let driver = Arc::new(
        Driver::new(node.config.clone(), backend.clone(), api.client())
            .await
            .unwrap(),
    );
    driver.recover().await.unwrap();
    let health = HealthMonitor::start(
        backend.clone(),
        backend.clone(),
        devices(2),
        HealthOptions {
            poll: LONG_POLL,
            ..HealthOptions::default()
        },
    )
    .await
    .unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let serving = serve_with(
        driver.clone(),
        ServeOptions {
            health: Some(health.clone()),
            health_resend: resend,
        },
        async move {
            let _ = rx.await;
        },
    )
    .await
    .unwrap();
    let mut reg = serving.registration();
    let kubelet = FakeKubelet::register(&serving.paths.registration, "gpu.carve.dev")
        .await
        .unwrap();
    assert_eq!(reg.wait().await, Ok(()));
    Plugin {
        driver,
        health,
        serving,
        kubelet,
        stop,
    }
}

impl Plugin {
    /// Stop server and monitor; the monitor's NVML wait is woken by an event.
    async fn stop(self, node: &Node, w: &mut Watch) {
        let _ = self.stop.send(());
        self.serving.wait().await.unwrap();
        assert!(
            within("stream end", w.next()).await.is_none(),
            "health stream ends at shutdown"
        );
        stop_monitor(&self.health, node).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_stream_follows_xids_and_a_reset_gpu_is_healthy_again() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 2, true)]);
    let api = api().await;
    let backend = open(&node);
    let p = start(&node, &api, &backend, None).await;
    assert_eq!(
        p.kubelet.info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    let all = devices(2);
    let mut w = watch(&p.serving).await;
    let first = next(&mut w).await;
    assert_eq!(
        first.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
        names(&all),
        "the complete list, in order"
    );
    assert!(
        first
            .iter()
            .all(|r| r.1 == hv::HealthStatus::Healthy && r.2.is_empty()),
        "{first:?}"
    );
    assert!(p.health.snapshot().taints.is_empty());

    // A claim puts a 1g.10gb instance on GPU 0 at start 0.
    let mig = DeviceName::mig(0, "1g.10gb", 0).unwrap().to_string();
    let claim = put_claim(&api, "c1", "uid-1", &[("req", &mig)], serde_json::json!([]));
    let r = p
        .kubelet
        .prepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(r.claims["uid-1"].error, "");
    let gis = backend.gpu_instances(0).unwrap();
    assert_eq!(gis.len(), 1);
    let gi = gis[0].id;

    // XID 79 on GPU 1: GPU 1 and every device on it.
    inject_event(&node.sim, &SimEvent::xid(1, 79)).unwrap();
    let rows = next(&mut w).await;
    let gpu1: Vec<String> = all
        .iter()
        .filter(|d| d.gpu() == 1)
        .map(ToString::to_string)
        .collect();
    assert_eq!(unhealthy(&rows), gpu1);
    let msg = &rows.iter().find(|r| r.0 == "gpu-1-mig-7g80gb-0").unwrap().2;
    assert!(msg.contains("XID 79"), "{msg}");
    let snap: HealthSnapshot = p.health.snapshot();
    assert_eq!(snap.taints.keys().cloned().collect::<Vec<_>>(), {
        let mut s = gpu1.clone();
        s.sort();
        s
    });
    for t in snap.taints.values() {
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].key, XID_TAINT_KEY);
        assert_eq!(t[0].value.as_deref(), Some("79"));
        assert_eq!(t[0].effect, "NoSchedule");
    }

    // XID 31 (application fault) on the instance changes nothing; XID 95 on it
    // makes that MIG device (and its MPS variant, not listed here) unhealthy.
    inject_event(&node.sim, &SimEvent::xid(0, 31).on_instance(gi, 0)).unwrap();
    inject_event(&node.sim, &SimEvent::xid(0, 95).on_instance(gi, 0)).unwrap();
    let rows = next(&mut w).await;
    let mut want = vec![mig.clone()];
    want.extend(gpu1.iter().cloned());
    assert_eq!(unhealthy(&rows), want);
    let msg = &rows.iter().find(|r| r.0 == mig).unwrap().2;
    assert!(msg.contains("XID 95") && !msg.contains("XID 31"), "{msg}");
    let snap = p.health.snapshot();
    assert_eq!(snap.taints[&mig][0].value.as_deref(), Some("95"));
    assert!(!snap.taints.contains_key("gpu-0"));
    assert!(!snap.taints.contains_key("gpu-0-mig-1g10gb-1"));

    let r = p
        .kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(r.claims["uid-1"].error, "");
    let driver = p.driver.clone();
    p.stop(&node, &mut w).await;
    drop(driver);
    assert_eq!(Arc::strong_count(&backend), 1, "nothing else holds NVML");
    drop(backend);

    // Both GPUs are reset; the plugin comes back with every device healthy and
    // resends the list without changes.
    simulate_gpu_reset(&node.sim, 0).unwrap();
    simulate_gpu_reset(&node.sim, 1).unwrap();
    let backend = open(&node);
    let p = start(&node, &api, &backend, Some(Duration::from_millis(20))).await;
    let mut w = watch(&p.serving).await;
    for _ in 0..2 {
        let rows = next(&mut w).await;
        assert_eq!(rows.len(), all.len());
        assert!(unhealthy(&rows).is_empty(), "{rows:?}");
    }
    assert!(p.health.snapshot().taints.is_empty());
    p.stop(&node, &mut w).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_gpu_seen_again_has_been_reset() {
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 2, true)]);
    // The monitor's first probe reads GPU 0's then GPU 1's MIG mode: GPU 1 is
    // lost (NVML_ERROR_GPU_IS_LOST) then, and answers again afterwards.
    node.sim.faults.push(Fault {
        function: "nvmlDeviceGetMigMode".into(),
        nth: 2,
        action: FaultAction::Fail { code: 15 },
    });
    node.write_sim_config();
    let backend = open(&node);
    let events: Arc<dyn GpuEvents> = backend.clone();
    let h = HealthMonitor::start(
        backend.clone(),
        events,
        devices(2),
        HealthOptions {
            poll: LONG_POLL,
            ..HealthOptions::default()
        },
    )
    .await
    .unwrap();
    let zero = HealthMonitor::start(
        backend.clone(),
        backend.clone(),
        devices(2),
        HealthOptions {
            poll: Duration::ZERO,
            ..HealthOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert!(zero.to_string().contains("poll interval"), "{zero}");
    let mut rx = h.subscribe();
    let first = rx.borrow_and_update().clone();
    assert_eq!(first.generation, 0);
    let lost: Vec<String> = first
        .devices
        .iter()
        .filter(|d| d.status == HealthStatus::Unhealthy)
        .map(|d| d.device.to_string())
        .collect();
    assert_eq!(
        lost,
        names(&devices(2))
            .into_iter()
            .filter(|d| d.starts_with("gpu-1"))
            .collect::<Vec<_>>()
    );
    let t = &first.taints["gpu-1"];
    assert_eq!(
        (t[0].key.as_str(), t[0].effect.as_str()),
        (GPU_LOST_TAINT_KEY, "NoSchedule")
    );
    // Wake the loop with an ignored event: the next probe finds GPU 1 again.
    inject_event(&node.sim, &SimEvent::xid(0, 43)).unwrap();
    within("a change", rx.changed()).await.unwrap();
    let snap = rx.borrow_and_update().clone();
    assert_eq!(snap.generation, 1);
    assert!(snap.taints.is_empty(), "{:?}", snap.taints);
    assert!(
        snap.devices
            .iter()
            .all(|d| d.status == HealthStatus::Healthy)
    );
    stop_monitor(&h, &node).await;
    assert!(
        within("the end", rx.changed()).await.is_err(),
        "snapshots end when the loop stops"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_monitor_health_is_neither_advertised_nor_served() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let driver = Arc::new(
        Driver::new(node.config.clone(), node.backend(), api.client())
            .await
            .unwrap(),
    );
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let serving = serve(driver, async move {
        let _ = rx.await;
    })
    .await
    .unwrap();
    let k = FakeKubelet::register(&serving.paths.registration, "gpu.carve.dev")
        .await
        .unwrap();
    assert_eq!(
        k.info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    let mut c = hv::dra_resource_health_client::DraResourceHealthClient::new(
        uds_channel(&serving.paths.dra).await.unwrap(),
    );
    let e = c
        .node_watch_resources(hv::NodeWatchResourcesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e}");
    let _ = stop.send(());
    serving.wait().await.unwrap();
}
