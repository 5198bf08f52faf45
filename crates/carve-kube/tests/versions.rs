//! The publisher on every supported Kubernetes version and through an
//! upgrade, against the API-server stand-in (which enforces the rules of the
//! version it reports and drops the fields of a gate that is off).

use std::collections::BTreeMap;
use std::time::Duration;

use carve_apiserver::{ApiServer, FeatureGate, KubeVersion as ServerVersion, Options, Resource};
use carve_kube::desired::with_taints;
use carve_kube::{PublishError, SlicePublisher, VersionWatch, skew_warning};
use carve_model::DRIVER_NAME;
use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
use carve_model::slices::{
    KubeLayout, KubeVersion, NodeGpu, SliceOptions, build_slices, simulated_node,
    validate_slices_for_version,
};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use kube::api::{Api, WatchEvent, WatchParams};

const NODE: &str = "node-a";

async fn server(v: KubeVersion) -> ApiServer {
    ApiServer::start(Options {
        version: ServerVersion {
            major: v.major,
            minor: v.minor,
        },
        ..Options::default()
    })
    .await
    .unwrap()
}

fn publisher(s: &ApiServer) -> SlicePublisher {
    SlicePublisher::new(s.client(), NODE, DRIVER_NAME)
}

/// Two H100s with MIG, MPS and time-slice devices, in `layout`.
fn build(layout: KubeLayout) -> Vec<ResourceSlice> {
    let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 2)
        .unwrap()
        .into_iter()
        .map(NodeGpu::dynamic)
        .collect();
    let mut o = SliceOptions::new(NODE, layout);
    o.sharing.mps_caps = Some(MpsCapabilities {
        memory_limit: MemoryLimit::Hard,
        compute_limit: ComputeLimit::Percentage,
    });
    o.sharing.mps = true;
    o.sharing.timeslice = true;
    build_slices(&gpus, &o).unwrap()
}

fn taint(key: &str, value: &str, effect: &str) -> DeviceTaint {
    DeviceTaint {
        key: key.into(),
        value: Some(value.into()),
        effect: effect.into(),
        time_added: None,
    }
}

/// A warning (effect None) on GPU 0 and its MPS device, a fatal XID on GPU 1.
fn health_taints() -> BTreeMap<String, Vec<DeviceTaint>> {
    let mut m = BTreeMap::new();
    for d in ["gpu-0", "gpu-0-mps"] {
        m.insert(
            d.to_string(),
            vec![taint("gpu.carve.dev/xid", "94", "None")],
        );
    }
    m.insert(
        "gpu-1".to_string(),
        vec![taint("gpu.carve.dev/xid", "79", "NoSchedule")],
    );
    m
}

fn stored(s: &ApiServer) -> Vec<ResourceSlice> {
    s.store()
        .list(Resource::ResourceSlices)
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect()
}

#[tokio::test]
async fn publishes_clean_on_1_34_1_35_and_1_36_with_taints_and_sharing_devices() {
    for v in [KubeVersion::V1_34, KubeVersion::V1_35, KubeVersion::V1_36] {
        let s = server(v).await;
        let watch = VersionWatch::new(s.client()).await.unwrap();
        assert_eq!(watch.version(), v);
        let base = build(v.layout().unwrap());
        let t = with_taints(&base, &health_taints(), v).unwrap();
        let report = publisher(&s)
            .sync(&t.slices)
            .await
            .unwrap_or_else(|e| panic!("{v}: {e}"));
        assert_eq!(report.created, t.slices.len(), "{v}");
        let got = stored(&s);
        validate_slices_for_version(&got, v).unwrap_or_else(|e| panic!("{v}: {e}"));
        let devices: BTreeMap<&str, _> = got
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.as_str(), d))
            .collect();
        let effects = |n: &str| -> Vec<String> {
            devices[n]
                .taints
                .iter()
                .flatten()
                .map(|t| t.effect.clone())
                .collect()
        };
        assert_eq!(effects("gpu-1"), ["NoSchedule"], "{v}");
        if v == KubeVersion::V1_34 {
            assert!(effects("gpu-0").is_empty(), "None withheld on 1.34");
            assert_eq!(t.withheld.len(), 2);
        } else {
            assert_eq!(effects("gpu-0"), ["None"], "{v}");
            assert_eq!(effects("gpu-0-mps"), ["None"], "{v}");
        }
        assert_eq!(
            devices["gpu-0-mps"].allow_multiple_allocations,
            Some(true),
            "{v}"
        );
        assert_eq!(
            devices["gpu-0-ts"].allow_multiple_allocations,
            Some(true),
            "{v}"
        );
        // The version's layout.
        let mixed = got
            .iter()
            .any(|s| s.spec.devices.is_some() && s.spec.shared_counters.is_some());
        assert_eq!(mixed, v == KubeVersion::V1_34, "{v}");
    }
}

#[tokio::test]
async fn dropped_taints_stop_the_sync_naming_dra_device_taints() {
    let v = KubeVersion::V1_35;
    let s = server(v).await;
    s.set_feature_gate(FeatureGate::DeviceTaints, false);
    let t = with_taints(&build(v.layout().unwrap()), &health_taints(), v).unwrap();
    let e = publisher(&s)
        .sync(&t.slices)
        .await
        .expect_err("taints dropped");
    assert!(
        matches!(&e, PublishError::FieldsDropped { gate, .. } if gate.name() == "DRADeviceTaints"),
        "{e}"
    );
    let msg = e.to_string();
    for part in [
        "DRADeviceTaints",
        "taints of ",
        "gpu-0",
        "feature gate is off",
    ] {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }
    assert!(!msg.contains("DRAConsumableCapacity"), "{msg}");
}

#[tokio::test]
async fn dropped_sharing_fields_stop_the_sync_naming_dra_consumable_capacity() {
    let v = KubeVersion::V1_35;
    let s = server(v).await;
    s.set_feature_gate(FeatureGate::ConsumableCapacity, false);
    let desired = build(v.layout().unwrap());
    let e = publisher(&s)
        .sync(&desired)
        .await
        .expect_err("sharing fields dropped");
    assert!(
        matches!(&e, PublishError::FieldsDropped { gate, .. } if gate.name() == "DRAConsumableCapacity"),
        "{e}"
    );
    let msg = e.to_string();
    for part in [
        "DRAConsumableCapacity",
        "allowMultipleAllocations of ",
        "requestPolicy of ",
        "-mps",
        "published as exclusive devices",
    ] {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }
    // Without sharing devices the same server takes the slices.
    let plain = {
        let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 2)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        build_slices(&gpus, &SliceOptions::new(NODE, KubeLayout::V135Plus)).unwrap()
    };
    let r = publisher(&s).sync(&plain).await.unwrap();
    assert_eq!(r.created + r.updated, plain.len());
}

/// The layout of a stored slice: `Some(true)` for the 1.34 one (counter sets
/// beside devices), `Some(false)` for a 1.35 slice, `None` for a slice without
/// counters or consumers (valid in both).
fn is_134(s: &ResourceSlice) -> Option<bool> {
    let consumes = s
        .spec
        .devices
        .iter()
        .flatten()
        .any(|d| d.consumes_counters.is_some());
    match (s.spec.shared_counters.is_some(), s.spec.devices.is_some()) {
        (true, true) => Some(true),
        (true, false) => Some(false),
        (false, _) if consumes => Some(false),
        _ => None,
    }
}

#[tokio::test]
async fn an_upgrade_from_1_34_to_1_35_republishes_the_pool_without_mixing_layouts() {
    let s = server(KubeVersion::V1_34).await;
    let mut watch = VersionWatch::new(s.client()).await.unwrap();
    let mut p = publisher(&s);
    let first = p
        .sync(&build(watch.version().layout().unwrap()))
        .await
        .unwrap();
    assert_eq!(first.generation, Some(0));
    let before = stored(&s);
    assert!(before.iter().all(|s| is_134(s) != Some(false)));
    assert!(before.iter().any(|s| is_134(s) == Some(true)));
    // Nothing changed: a refresh reports nothing.
    assert_eq!(watch.refresh().await.unwrap(), None);

    // Watch every slice event from here on.
    let api: Api<ResourceSlice> = Api::all(s.client());
    let rv = s.store().resource_version().to_string();
    let mut events = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();

    // The control plane moves to 1.35 under the running publisher.
    s.set_version(ServerVersion {
        major: 1,
        minor: 35,
    });
    let change = watch.refresh().await.unwrap().expect("a version change");
    assert!(change.layout_changed());
    assert!(skew_warning(change).is_some());
    let report = p
        .sync(&build(watch.version().layout().unwrap()))
        .await
        .unwrap();
    assert_eq!(report.generation, Some(1));

    // The pool now: the 1.35 layout only, valid for 1.35.
    let now = stored(&s);
    validate_slices_for_version(&now, KubeVersion::V1_35).unwrap();
    assert!(
        now.iter().all(|s| is_134(s) != Some(true)),
        "1.34 slices left"
    );
    assert!(now.iter().all(|s| s.spec.pool.generation == 1));

    // Replay every event: at no point does the newest generation of the pool
    // hold both layouts, and whenever it is complete it is one valid pool.
    let mut state: BTreeMap<String, ResourceSlice> = before
        .into_iter()
        .map(|s| (s.metadata.name.clone().unwrap(), s))
        .collect();
    let expected = report.writes();
    let mut seen = 0;
    while seen < expected {
        let ev = tokio::time::timeout(Duration::from_secs(10), events.try_next())
            .await
            .expect("watch event")
            .unwrap()
            .expect("watch open");
        match ev {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                state.insert(o.metadata.name.clone().unwrap(), o);
            }
            WatchEvent::Deleted(o) => {
                state.remove(&o.metadata.name.clone().unwrap());
            }
            _ => continue,
        }
        seen += 1;
        let top = state
            .values()
            .map(|s| s.spec.pool.generation)
            .max()
            .unwrap();
        let newest: Vec<ResourceSlice> = state
            .values()
            .filter(|s| s.spec.pool.generation == top)
            .cloned()
            .collect();
        let layouts: std::collections::BTreeSet<bool> = newest.iter().filter_map(is_134).collect();
        assert!(
            layouts.len() <= 1,
            "generation {top} mixes layouts after {seen} events"
        );
        let complete = newest.len() as i64 == newest[0].spec.pool.resource_slice_count;
        if complete {
            let v = if layouts.contains(&true) {
                KubeVersion::V1_34
            } else {
                KubeVersion::V1_35
            };
            validate_slices_for_version(&newest, v).unwrap();
        }
    }
}

/// A client of an address nothing listens on: every request is refused.
fn refused_client() -> kube::Client {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let uri = format!("http://127.0.0.1:{port}").parse().unwrap();
    kube::Client::try_from(kube::Config::new(uri)).unwrap()
}

#[tokio::test]
async fn a_version_read_is_recorded_and_used_when_the_server_does_not_answer() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("apiserver-version");
    let s = server(KubeVersion::V1_36).await;
    let (w, unread) = VersionWatch::new_or_recorded(s.client(), &record)
        .await
        .unwrap();
    assert_eq!(w.version(), KubeVersion::V1_36);
    assert!(unread.is_none());
    assert_eq!(std::fs::read_to_string(&record).unwrap().trim(), "1.36");

    // The server is down at the next start: the recorded version, and why.
    let (w, unread) = VersionWatch::new_or_recorded(refused_client(), &record)
        .await
        .unwrap();
    assert_eq!(w.version(), KubeVersion::V1_36);
    assert!(
        matches!(unread, Some(PublishError::Version { .. })),
        "{unread:?}"
    );
}

#[tokio::test]
async fn without_a_record_an_unanswered_version_read_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("apiserver-version");
    let r = VersionWatch::new_or_recorded(refused_client(), &record).await;
    assert!(matches!(r, Err(PublishError::Version { .. })), "{r:?}");
    // An unreadable record is no record.
    std::fs::write(&record, "not a version\n").unwrap();
    let r = VersionWatch::new_or_recorded(refused_client(), &record).await;
    assert!(r.is_err());
}
